"""The lean loop's attention for one sequence with several new tokens (``rooflm.models.cpu_lean_seq``): a verify step
of 2, 5 or 17 tokens after a cached context, a token tree's verify step and a chunked prefill give the module path's
logits and cache, bit for bit, with consecutive and scattered KV blocks and grouped-query attention; the steps it
must leave to the backend (several sequences, a sliding window, a slot not written) still go there."""
from __future__ import annotations

import json

import pytest
import torch

import rooflm.models.cpu_lean as lean_module
from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
from rooflm.loader import load_model
from rooflm.models.cpu_lean_seq import causal_mask
from rooflm.spec_decode.tree import attention_mask, tree_depths

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
GQA3 = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}  # three query heads per KV head
BLOCK = 4
PROMPT = [5, 17, 99, 3, 64, 12, 7, 88, 41, 23, 2]  # 11 tokens: the verify step starts inside a block
CONSECUTIVE = list(range(3, 13))  # not from block 0: the view starts at an offset
SCATTERED = [7, 2, 9, 0, 4, 11, 1, 3, 8, 5]


def _load(tmp_path_factory, quantization: str, **overrides):
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return load_model(str(folder / "config.json"), load_format="dummy", show_progress=False,
                      quantization=quantization)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {"w4a16": _load(tmp_path_factory, "w4a16"), "none": _load(tmp_path_factory, "none"),
            "gqa3": _load(tmp_path_factory, "w4a16", **GQA3)}


def _count_seq_attention(monkeypatch) -> list[int]:
    """Counts the layers that attended through ``attend_seq``."""
    calls = []
    real = lean_module.attend_seq

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(lean_module, "attend_seq", counting)
    return calls


def _run(model, cfg, table, steps, tree=None):
    """Runs ``steps`` [(cached tokens, new tokens)] of one sequence over ``table``; returns every step's logits (all
    rows) and the caches at the end. ``tree``: parents of a token tree for the last step."""
    caches = allocate_kv_caches(cfg.num_hidden_layers, max(table) + 1, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    logits = []
    with torch.inference_mode():
        for i, (done, ids) in enumerate(steps):
            meta, positions = build_attention_metadata([table], [done], [len(ids)], BLOCK)
            if tree is not None and i == len(steps) - 1:
                meta.tree_masks = [attention_mask(tree)]
                positions = torch.tensor(tree_depths(tree, done))
            logits.append(model.compute_logits(model(torch.tensor(ids), positions, caches, meta)))
    return logits, caches


def _compare(monkeypatch, model, cfg, table, steps, tree=None) -> int:
    """Lean against the module path, bit for bit; returns how many layers attended through ``attend_seq``."""
    calls = _count_seq_attention(monkeypatch)
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    lean_logits, lean_caches = _run(model, cfg, table, steps, tree)
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "off")
    plain_logits, plain_caches = _run(model, cfg, table, steps, tree)
    for step, (a, b) in enumerate(zip(lean_logits, plain_logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item():.3g}"
    for a, b in zip(lean_caches, plain_caches, strict=True):
        assert torch.equal(a, b)
    return len(calls)


def _verify_steps(n: int):
    """Prefill the prompt, decode one token, verify ``n`` tokens, then decode after them (reads what they wrote)."""
    drafts = [(11 * i + 6) % TINY["vocab_size"] for i in range(n)]
    done = len(PROMPT)
    return [(0, PROMPT), (done, [9]), (done + 1, drafts), (done + 1 + n, [30])]


@pytest.mark.parametrize("n", [2, 5, 17])
@pytest.mark.parametrize("table", [CONSECUTIVE, SCATTERED], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("kind", ["w4a16", "none", "gqa3"])
@pytest.mark.parametrize("native", ["auto", "off"], ids=["native-ops", "torch-ops"])
def test_verify_step_matches_module_path(monkeypatch, models, kind, table, n, native) -> None:
    """With the native CPU operators (RMSNorm, rotary + cache write, attention) and without them: each path's lean
    loop computes its module path's floats."""
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", native)
    model, cfg = models[kind]
    calls = _compare(monkeypatch, model, cfg, table, _verify_steps(n))
    assert calls == 2 * cfg.num_hidden_layers  # the prefill and the verify step; decode steps have their own path


@pytest.mark.parametrize("table", [CONSECUTIVE, SCATTERED], ids=["consecutive", "scattered"])
def test_chunked_prefill_matches_module_path(monkeypatch, models, table) -> None:
    model, cfg = models["gqa3"]
    prompt = [(7 * i + 3) % TINY["vocab_size"] for i in range(30)]
    steps = [(0, prompt[:6]), (6, prompt[6:13]), (13, prompt[13:]), (30, [4])]
    assert _compare(monkeypatch, model, cfg, table, steps) == 3 * cfg.num_hidden_layers


@pytest.mark.parametrize("table", [CONSECUTIVE, SCATTERED], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("native", ["auto", "off"], ids=["native-ops", "torch-ops"])
def test_token_tree_verify_step_matches_module_path(monkeypatch, models, table, native) -> None:
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", native)
    model, cfg = models["gqa3"]
    parents = (0, 0, 1, 1, 2, 3)  # under the root: two children, three grandchildren, one great-grandchild
    steps = [(0, PROMPT), (len(PROMPT), [8, 40, 41, 50, 51, 60, 70])]
    assert _compare(monkeypatch, model, cfg, table, steps, tree=parents) == 2 * cfg.num_hidden_layers


def test_mask_is_causal_after_the_cached_prefix() -> None:
    mask = causal_mask(3, 7, None)
    assert mask.tolist() == [[True] * 5 + [False] * 2, [True] * 6 + [False], [True] * 7]
    assert causal_mask(4, 4, None) is None  # no prefix: is_causal says the same
    tree = attention_mask((0, 0))
    assert torch.equal(causal_mask(3, 5, tree), torch.cat([torch.ones(3, 2, dtype=torch.bool), tree], dim=1))


def test_two_sequences_go_to_the_backend(monkeypatch, models) -> None:
    model, cfg = models["w4a16"]
    calls = _count_seq_attention(monkeypatch)
    runs = []
    for flag in ("on", "off"):
        monkeypatch.setenv("ROOFLM_CPU_LEAN", flag)
        caches = allocate_kv_caches(cfg.num_hidden_layers, 8, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
        with torch.inference_mode():
            meta, pos = build_attention_metadata([[0, 1, 2], [5, 6, 7]], [0, 0], [9, 5], BLOCK)
            first = model(torch.tensor(PROMPT[:9] + PROMPT[:5]), pos, caches, meta)
            meta, pos = build_attention_metadata([[0, 1, 2], [5, 6, 7]], [9, 5], [3, 2], BLOCK)
            runs.append((first, model(torch.tensor([1, 2, 3, 4, 5]), pos, caches, meta)))
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_sliding_window_goes_to_the_backend(monkeypatch, tmp_path_factory) -> None:
    model, cfg = _load(tmp_path_factory, "w4a16", model_type="mistral", architectures=["MistralForCausalLM"],
                       sliding_window=6)
    calls = _count_seq_attention(monkeypatch)
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    lean_logits, _ = _run(model, cfg, CONSECUTIVE, _verify_steps(5))
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "off")
    plain_logits, _ = _run(model, cfg, CONSECUTIVE, _verify_steps(5))
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(lean_logits, plain_logits, strict=True))


def test_unwritten_slot_goes_to_the_backend(monkeypatch, models) -> None:
    """A slot of -1 (a token whose K/V is not kept) is skipped by the backend's write; the inline write would not."""
    model, cfg = models["w4a16"]
    calls = _count_seq_attention(monkeypatch)
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    caches = allocate_kv_caches(cfg.num_hidden_layers, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    meta, positions = build_attention_metadata([[0, 1, 2]], [0], [len(PROMPT)], BLOCK)
    meta.slot_mapping[-1] = -1
    with torch.inference_mode():
        model(torch.tensor(PROMPT), positions, caches, meta)
    assert calls == []
    assert not caches[0][:, 2, 2].any()  # the last token's slot (block 2, offset 2) stayed empty


@pytest.mark.parametrize("table", [CONSECUTIVE, SCATTERED], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa3", "mha"])
def test_a_verify_step_attends_each_token_as_a_decode_step_does(table, heads) -> None:
    """Greedy speculation keeps the plain path's tokens only if a verify step scores each drafted token with the
    decode step's floats: each row of a 5-token step's attention equals, bit for bit, the decode step's attention for
    that token alone (the lean loop's attention equals the backend's: the tests above). Whole-model logits are not
    compared: a float matmul of 5 rows may round differently from one of 1 row (the native quantized kernel does
    not: its rows are independent, see tests/quantization/test_cpu_native.py)."""
    from rooflm.attention.cpu_backend import CpuAttention

    hq, hkv, d, ctx, new = *heads, 16, 11, 5
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, max(table) + 1, BLOCK, hkv, d, generator=g)
    q = torch.randn(new, hq, d, generator=g)
    meta, _ = build_attention_metadata([table], [ctx], [new], BLOCK)
    verify = CpuAttention().attend(q, cache, meta, d ** -0.5)
    for i in range(new):
        meta, _ = build_attention_metadata([table], [ctx + i], [1], BLOCK)
        assert torch.equal(CpuAttention().attend(q[i:i + 1], cache, meta, d ** -0.5), verify[i:i + 1]), i


@pytest.mark.parametrize("native", ["auto", "off"])
def test_backend_prefill_attention_takes_the_fused_kernel_for_long_chunks_only(monkeypatch, models, native) -> None:
    """torch runs its fused CPU attention only on 4-D tensors (3-D ones fall back to the unfused maths): the
    backend's prefill attention, which the module path and the lean loop's fallback use, passes 4-D ones for a chunk
    longer than EXACT_MAX_QUERY tokens and 3-D ones for a short prompt; a verify-sized step after a cached prefix
    attends as decode steps do: one native call per layer for its five tokens, or without the native operators five
    4-D calls of torch's per layer."""
    from rooflm.attention import cpu_backend

    monkeypatch.setenv("ROOFLM_CPU_NATIVE", native)
    model, cfg = models["gqa3"]
    dims, native_tokens = [], []
    real = torch.nn.functional.scaled_dot_product_attention
    real_native = cpu_backend.native_attend

    def recording(q, *args, **kwargs):
        dims.append(q.dim())
        return real(q, *args, **kwargs)

    def recording_native(q, *args, **kwargs):
        out = real_native(q, *args, **kwargs)
        if out is not None:
            native_tokens.append(q.shape[0])
        return out

    monkeypatch.setattr(cpu_backend.F, "scaled_dot_product_attention", recording)
    monkeypatch.setattr(cpu_backend, "native_attend", recording_native)
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "off")
    _run(model, cfg, CONSECUTIVE, [(0, PROMPT)])  # a short prompt: one 3-D call per layer
    assert dims and set(dims) == {3}
    dims.clear()
    native_tokens.clear()
    _run(model, cfg, CONSECUTIVE, [(0, PROMPT), (len(PROMPT), [31, 7, 90, 4, 66])])  # then verify 5, as decode steps
    if native == "off":
        assert dims.count(4) == 5 * cfg.num_hidden_layers and not native_tokens
    else:
        assert native_tokens == [5] * cfg.num_hidden_layers and dims.count(4) == 0
    dims.clear()
    long = (PROMPT * 4)[: cpu_backend.EXACT_MAX_QUERY + 1]
    _run(model, cfg, CONSECUTIVE, [(0, long)])
    assert dims and set(dims) == {4}
    assert torch._fused_sdp_choice(torch.zeros(1, 6, 5, 16), torch.zeros(1, 2, 9, 16), torch.zeros(1, 2, 9, 16),
                                   torch.ones(5, 9, dtype=torch.bool), enable_gqa=True) != 0  # 0: the unfused maths
