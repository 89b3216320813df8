"""Each op chooses its implementation once, at construction, from the op selection (CustomOp, op_selection,
select_ops). CPU only: nothing here imports triton (the Triton path itself is checked in tests/kernels)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
from rooflm.config import ModelConfig, load_model_config
from rooflm.layers.attention import Attention
from rooflm.layers.custom_op import (
    CustomOp,
    OpSelection,
    chosen_ops,
    current_op_selection,
    op_selection,
    select_ops,
    triton_available,
)
from rooflm.layers.linear import Linear
from rooflm.loader import load_model
from rooflm.loader.dummy import init_dummy_weights
from rooflm.models import get_model_class

KERNEL_MODULES = ("triton", "rooflm.kernels.gemv", "rooflm.kernels.rmsnorm", "rooflm.kernels.activation",
                  "rooflm.kernels.kv_cache", "rooflm.kernels.decode_attention", "rooflm.kernels.prefill_attention",
                  "rooflm.attention.triton_backend")


def tiny_config(arch: str = "llama") -> ModelConfig:
    if arch == "mixtral":
        base = load_model_config("mixtral-8x7b").hf_config
        d = {**base, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2}
    else:
        d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 64,
             "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    return ModelConfig.from_hf_dict(d)


def build(cfg: ModelConfig, device: str, ops: str, attention: str = "auto", seed: int = 0) -> torch.nn.Module:
    with op_selection(device, ops, attention):
        model = get_model_class(cfg)(cfg)
    init_dummy_weights(model, seed)
    with torch.no_grad():  # norm weights away from 1 so the norms' weights matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed + 1))
    return model.eval()


@torch.no_grad()
def run_steps(model: torch.nn.Module, cfg: ModelConfig) -> torch.Tensor:
    """Two sequences: a prefill of 5 and 3 tokens, then two batched decode steps. Returns every step's logits."""
    bs = 4
    caches = allocate_kv_caches(cfg.num_hidden_layers, 8, bs, cfg.num_key_value_heads, cfg.head_dim)
    tables = [[3, 0], [5, 1]]
    g = torch.Generator().manual_seed(11)
    out, done = [], [0, 0]
    for new in ([5, 3], [1, 1], [1, 1]):
        meta, pos = build_attention_metadata(tables, done, new, bs)
        ids = torch.randint(0, cfg.vocab_size, (sum(new),), generator=g)
        out.append(model.compute_logits(model(ids, pos, caches, meta)))
        done = [d + n for d, n in zip(done, new)]
    return torch.cat(out)


def custom_ops(model: torch.nn.Module) -> list[CustomOp]:
    return [m for m in model.modules() if isinstance(m, CustomOp)]


def all_subclasses(cls: type) -> set[type]:
    subs = set(cls.__subclasses__())
    return subs.union(*(all_subclasses(s) for s in subs)) if subs else subs


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_native_model_never_calls_a_triton_kernel(monkeypatch, arch) -> None:
    """Built with ops="native" (even for a CUDA target), every op binds forward_native and the torch backend; no
    Triton path runs, even while a different selection is active during forward (the choice is not re-read)."""
    for cls in all_subclasses(CustomOp):
        if cls.forward_cuda is not cls.forward_native:
            def boom(self, *args, _cls=cls, **kwargs):
                raise AssertionError(f"{_cls.__name__}.forward_cuda ran in a native model")
            monkeypatch.setattr(cls, "forward_cuda", boom)
    for name in KERNEL_MODULES:  # any import of triton or a kernel module now raises ImportError
        monkeypatch.setitem(sys.modules, name, None)

    cfg = tiny_config(arch)
    model = build(cfg, "cuda", "native")
    ops = custom_ops(model)
    kinds = {type(m).__name__ for m in ops}
    assert {"Linear", "RMSNorm", "SiluAndMul", "Attention", "LMHead"} <= kinds
    if arch == "mixtral":
        assert "MixtralMoE" in kinds
    for m in ops:
        assert m.impl == "native"
        assert m._impl_fn is type(m).forward_native
    assert {m.backend.name for m in ops if isinstance(m, Attention)} == {"torch"}
    with op_selection("cuda", "triton", "triton"):
        logits = run_steps(model, cfg)
    assert torch.isfinite(logits).all()
    assert set(chosen_ops(model).values()) == {"native"}


def test_auto_on_cpu_chooses_the_cpu_path_in_the_loader(tmp_path) -> None:
    from rooflm.layers.norm import RMSNorm

    cfg = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg.hf_config))
    model, _ = load_model(str(tmp_path / "config.json"), device="cpu", ops="auto", show_progress=False)
    ops = custom_ops(model)
    assert len(ops) == len(chosen_ops(model)) > 0
    for m in ops:
        assert m.impl == "cpu", type(m).__name__
        # an op with a CPU implementation runs it; the others run their reference
        has_cpu = type(m).forward_cpu is not CustomOp.forward_cpu
        assert m._impl_fn is (type(m).forward_cpu if has_cpu else type(m).forward_native), type(m).__name__
    assert any(isinstance(m, RMSNorm) and m._impl_fn is RMSNorm.forward_cpu for m in ops)
    assert {m.backend.name for m in ops if isinstance(m, Attention)} == {"cpu"}
    native, _ = load_model(str(tmp_path / "config.json"), device="cpu", ops="native", show_progress=False)
    native.load_state_dict(model.state_dict())
    logits = run_steps(model, cfg)
    ref = run_steps(native, cfg)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_outside_any_selection_ops_are_native_and_selections_nest() -> None:
    assert current_op_selection().ops == "native"
    assert Linear(4, 3).impl == "native"
    with op_selection("cuda", "triton", attention="torch") as outer:
        assert current_op_selection() is outer
        with op_selection("cpu", "native") as inner:
            assert current_op_selection() is inner
        assert current_op_selection() is outer
    assert current_op_selection().ops == "native"


def test_auto_resolution_follows_device_triton_and_env(monkeypatch) -> None:
    monkeypatch.delenv("ROOFLM_KERNELS", raising=False)
    fast = "triton" if triton_available() else "native"
    assert OpSelection(torch.device("cpu")).impl() == "cpu"
    assert OpSelection(torch.device("cpu")).attention_impl() == "cpu"
    assert OpSelection(torch.device("cuda")).impl() == fast
    assert OpSelection(torch.device("cuda")).attention_impl() == ("triton" if fast == "triton" else "torch")
    assert OpSelection(torch.device("cuda"), attention="torch").attention_impl() == "torch"
    monkeypatch.setenv("ROOFLM_KERNELS", "0")
    assert OpSelection(torch.device("cpu")).impl() == "native"
    assert OpSelection(torch.device("cuda")).impl() == "native"
    assert OpSelection(torch.device("cuda")).attention_impl() == "torch"


def test_select_ops_rechooses_and_native_again_gives_the_same_logits() -> None:
    cfg = tiny_config()
    model = build(cfg, "cpu", "native")
    before = run_steps(model, cfg)
    if not triton_available():
        with pytest.raises(ValueError, match="ops='triton'"):
            select_ops(model, "triton", attention="torch")
        return
    chosen = select_ops(model, "triton", attention="torch")  # binds the Triton path; nothing runs it here
    assert chosen == chosen_ops(model) and len(chosen) == len(custom_ops(model))
    for m in custom_ops(model):
        if isinstance(m, Attention):
            assert m.impl == "native" and m.backend.name == "torch"
        else:
            assert m.impl == "triton" and m._impl_fn is type(m).forward_cuda
    assert set(select_ops(model, "native").values()) == {"native"}
    for m in custom_ops(model):
        assert m._impl_fn is type(m).forward_native
    assert torch.equal(run_steps(model, cfg), before)
    # auto re-chooses for the model's own device (its parameters live on the CPU): the CPU path
    select_ops(model, "triton", attention="torch")
    assert set(select_ops(model, "auto").values()) == {"cpu"}


def test_select_ops_native_equals_a_model_built_native() -> None:
    """A model built for a CUDA target with the fast path, re-selected to native, computes exactly what a model built
    native computes (same weights): re-selection leaves nothing of the first choice behind."""
    cfg = tiny_config("mixtral")
    native = build(cfg, "cpu", "native", seed=4)
    if triton_available():
        other = build(cfg, "cuda", "auto", attention="torch", seed=4)
        assert "triton" in chosen_ops(other).values()
    else:
        other = build(cfg, "cuda", "auto", seed=4)
    select_ops(other, "native")
    assert torch.equal(run_steps(other, cfg), run_steps(native, cfg))


def test_bad_values_name_the_field(tmp_path) -> None:
    with pytest.raises(ValueError, match="ops='fast'"):
        with op_selection("cpu", ops="fast"):
            pass
    with pytest.raises(ValueError, match="attention='flash'"):
        with op_selection("cpu", attention="flash"):
            pass
    assert current_op_selection().ops == "native"  # a failed entry leaves no selection behind
    with pytest.raises(ValueError, match="ops='gpu'"):
        select_ops(Linear(4, 3), "gpu")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().hf_config))
    with pytest.raises(ValueError, match="ops='eager'"):
        load_model(str(tmp_path / "config.json"), ops="eager", show_progress=False)
    with pytest.raises(ValueError, match="attn_backend='flash'"):
        load_model(str(tmp_path / "config.json"), attn_backend="flash", show_progress=False)
