"""A whole model on the Triton path (ops="triton", here under the interpreter on a CPU) against the same model
re-selected to the reference path with ``select_ops``: same logits within the dtype's tolerance, and every op bound
to the implementation the selection asked for."""
import pytest
import torch

from kernel_checks import assert_close


def tiny_config(arch: str):
    from rooflm.config import ModelConfig, load_model_config

    if arch == "mixtral":
        base = load_model_config("mixtral-8x7b").hf_config
        d = {**base, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2}
    else:  # Qwen2-style q/k/v bias and a sliding window on one of the two layers
        d = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 96, "hidden_size": 64,
             "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "sliding_window": 4, "use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]}
    return ModelConfig.from_hf_dict(d)


@torch.no_grad()
def run_steps(model, cfg, device, dtype) -> torch.Tensor:
    """Two sequences: prefill 6 and 3 tokens, then two batched decode steps, then a mixed extend step."""
    from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata

    bs = 4
    caches = allocate_kv_caches(cfg.num_hidden_layers, 10, bs, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
    tables = [[3, 0, 7], [5, 1, 8]]
    g = torch.Generator().manual_seed(5)
    out, done = [], [0, 0]
    for new in ([6, 3], [1, 1], [1, 1], [2, 1]):
        meta, pos = build_attention_metadata(tables, done, new, bs, device)
        ids = torch.randint(0, cfg.vocab_size, (sum(new),), generator=g).to(device)
        out.append(model.compute_logits(model(ids, pos, caches, meta)))
        done = [d + n for d, n in zip(done, new)]
    return torch.cat(out)


@pytest.mark.parametrize("arch", ["qwen2", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_model_matches_its_native_selection(device, arch, dtype):
    from rooflm.layers.attention import Attention
    from rooflm.layers.custom_op import CustomOp, chosen_ops, op_selection, select_ops
    from rooflm.loader.dummy import init_dummy_weights
    from rooflm.models import get_model_class

    cfg = tiny_config(arch)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), op_selection(device, ops="triton"):
            model = get_model_class(cfg)(cfg)
    finally:
        torch.set_default_dtype(old)
    init_dummy_weights(model, seed=2, std=0.1)
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    for m in ops:
        assert m.impl == "triton" and m._impl_fn is type(m).forward_cuda, type(m).__name__
    assert {m.backend.name for m in ops if isinstance(m, Attention)} == {"triton"}
    fast = run_steps(model, cfg, device, dtype)

    assert set(select_ops(model, "native").values()) == {"native"}
    assert {m.backend.name for m in ops if isinstance(m, Attention)} == {"torch"}
    ref = run_steps(model, cfg, device, dtype)
    # On a GPU, tl.dot multiplies float32 tiles in TF32 (10-bit mantissa) unless told otherwise, so a whole float32
    # model through the kernels agrees with the float32 reference to about fp16 rounding, not to float32's.
    tol_dtype = torch.float16 if dtype == torch.float32 and device == "cuda" else dtype
    assert_close(fast, ref, tol_dtype, f"{arch} logits, Triton path vs reference", scale=ref.abs().max().item())

    select_ops(model, "triton")  # and back: the Triton path again, the same logits as the first run
    assert set(chosen_ops(model).values()) == {"triton"}
    assert torch.equal(run_steps(model, cfg, device, dtype), fast)
