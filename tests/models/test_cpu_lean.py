"""The CPU path's lean decoder loop (``rooflm.models.cpu_lean``) against the module-by-module forward on the same
weights: the same floats, bit for bit, in every branch it takes (packed int4 / int8 / float projections, one
decoding sequence with consecutive or scattered KV blocks, a batch of sequences, prefill, a sliding window, a bias);
and the cases it must leave to the modules."""
from __future__ import annotations

import pytest
import torch

import rooflm.models.llama as llama_module
from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
from rooflm.layers.custom_op import select_ops
from rooflm.models.cpu_lean import lean_plan

from model_utils import TINY, load_tiny as _load

BLOCK = 4
PROMPT = [5, 17, 99, 3, 64, 12, 7, 88, 41]  # 9 tokens: 3 blocks of 4, the last one partly filled
DECODE_STEPS = 7  # crosses two block boundaries


def _greedy(model, cfg, tables: list[list[int]], prompts: list[list[int]], steps: int):
    """Prefill every prompt in one step, then ``steps`` batched greedy decode steps. Returns the logits of each step
    (rows: the sequences' last tokens) and the tokens chosen."""
    num_blocks = max(max(t) for t in tables) + 1
    caches = allocate_kv_caches(cfg.num_hidden_layers, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    done, new = [0] * len(prompts), [len(p) for p in prompts]
    ids = [t for p in prompts for t in p]
    all_logits, tokens = [], []
    with torch.inference_mode():
        for _ in range(steps + 1):
            meta, positions = build_attention_metadata(tables, done, new, BLOCK)
            hidden = model(torch.tensor(ids), positions, caches, meta)
            last = torch.tensor(meta.query_start_loc_cpu[1:]) - 1
            logits = model.compute_logits(hidden[last])
            all_logits.append(logits)
            ids = logits.argmax(-1).tolist()
            tokens.append(ids)
            done = [d + n for d, n in zip(done, new)]
            new = [1] * len(prompts)
    return all_logits, tokens


def _both_paths(monkeypatch, model, cfg, tables, prompts, steps=DECODE_STEPS):
    """(lean run, module run, how many forwards the lean loop computed)."""
    ran = []
    real = llama_module.run_lean_layers

    def counting(*args):
        out = real(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(llama_module, "run_lean_layers", counting)
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    lean = _greedy(model, cfg, tables, prompts, steps)
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "off")
    plain = _greedy(model, cfg, tables, prompts, steps)
    return lean, plain, sum(ran)


def _assert_identical(lean, plain) -> None:
    (lean_logits, lean_tokens), (plain_logits, plain_tokens) = lean, plain
    assert lean_tokens == plain_tokens
    for step, (a, b) in enumerate(zip(lean_logits, plain_logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("quantization", ["w4a16", "w8a16", "none", "w4a16-torch"])
@pytest.mark.parametrize("tables", [[[0, 1, 2, 3, 4]], [[6, 2, 9, 0, 4]]], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("native", ["auto", "off"], ids=["native-ops", "torch-ops"])
def test_one_sequence_matches_module_path(monkeypatch, tiny_models, quantization, tables, native) -> None:
    """Decode steps of one sequence, with the native CPU operators (RMSNorm, rotary + cache write, attention) and
    without them (``ROOFLM_CPU_NATIVE=off``): the lean loop computes the module path's floats either way."""
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", native)
    model, cfg = tiny_models[quantization]
    lean, plain, ran = _both_paths(monkeypatch, model, cfg, tables, [PROMPT])
    _assert_identical(lean, plain)
    assert ran == DECODE_STEPS + 1  # the prefill and every decode step went through the lean loop


def test_batch_of_sequences_matches_module_path(monkeypatch, tiny_models) -> None:
    model, cfg = tiny_models["w4a16"]
    lean, plain, ran = _both_paths(monkeypatch, model, cfg, [[0, 1, 2], [5, 3, 4]], [PROMPT[:6], PROMPT[2:]],
                                   steps=4)
    _assert_identical(lean, plain)
    assert ran == 5


@pytest.mark.parametrize("overrides", [{"attention_bias": True},
                                       {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                        "sliding_window": 6}], ids=["bias", "sliding_window"])
def test_bias_and_sliding_window_match_module_path(monkeypatch, tmp_path_factory, overrides) -> None:
    model, cfg = _load(tmp_path_factory, "w4a16", **overrides)
    lean, plain, ran = _both_paths(monkeypatch, model, cfg, [[0, 1, 2, 3, 4]], [PROMPT])
    _assert_identical(lean, plain)
    assert ran == DECODE_STEPS + 1


def test_left_to_modules_off_the_cpu_path(monkeypatch, tiny_models) -> None:
    model, _ = tiny_models["w4a16"]
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    assert lean_plan(model.model) is not None
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "off")
    assert lean_plan(model.model) is None
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    try:
        select_ops(model, "native")  # the reference path: the modules, whatever the environment says
        assert lean_plan(model.model) is None
    finally:
        select_ops(model, "auto")
    assert lean_plan(model.model) is not None


def test_quantized_kv_cache_is_left_to_modules(monkeypatch, tiny_models) -> None:
    model, cfg = tiny_models["w4a16"]
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    caches = allocate_kv_caches(cfg.num_hidden_layers, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                                kv_cache_dtype="int8")
    meta, positions = build_attention_metadata([[0, 1, 2]], [0], [len(PROMPT)], BLOCK)
    embedded = model.model.embed_tokens(torch.tensor(PROMPT))
    cos, sin = model.model.rotary_emb.cos_sin(positions, embedded.dtype)
    assert llama_module.run_lean_layers(lean_plan(model.model), embedded, None, cos, sin, caches, meta) is None


def test_long_prefill_matches_module_path(monkeypatch, tiny_models) -> None:
    """A prefill of more rows than the lean loop widens inside the residual add (it casts first there)."""
    model, cfg = tiny_models["w4a16"]
    prompt = [(7 * i + 3) % TINY["vocab_size"] for i in range(80)]
    lean, plain, ran = _both_paths(monkeypatch, model, cfg, [list(range(22))], [prompt], steps=2)
    _assert_identical(lean, plain)
    assert ran == 3


def test_forward_hooks_send_the_step_to_the_modules(monkeypatch, tiny_models) -> None:
    """Calibration (statistics from pre-hooks on the projections) and weight offload hook the modules: while a hook
    is registered the modules run the step, so the hook sees every call; once removed, the lean loop is back."""
    model, cfg = tiny_models["w4a16"]
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    assert lean_plan(model.model) is not None  # the plan (and the hook dictionaries it watches) cached first
    for register in ("register_forward_hook", "register_forward_pre_hook"):
        h = getattr(model.model.layers[0].self_attn.o_proj, register)(lambda *a: None)
        assert lean_plan(model.model) is None
        h.remove()
        assert lean_plan(model.model) is not None
    seen = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    try:
        lean, plain, ran = _both_paths(monkeypatch, model, cfg, [[0, 1, 2, 3, 4]], [PROMPT], steps=2)
    finally:
        handle.remove()
    assert ran == 0 and len(seen) == 2 * 3  # both runs, prefill and two decode steps each
    _assert_identical(lean, plain)
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    assert lean_plan(model.model) is not None


def test_caches_carved_from_one_buffer_match_module_path(monkeypatch, tiny_models) -> None:
    """Each layer's cache a view at an offset into one buffer: the lean loop's context views start there too."""
    model, cfg = tiny_models["w4a16"]
    shape = (2, 6, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    runs = []
    for flag in ("on", "off"):
        monkeypatch.setenv("ROOFLM_CPU_LEAN", flag)
        buffer = torch.zeros(cfg.num_hidden_layers + 1, *shape)
        caches = [buffer[i + 1] for i in range(cfg.num_hidden_layers)]  # never at offset 0
        ids, done, new, outs = PROMPT, 0, len(PROMPT), []
        with torch.inference_mode():
            for _ in range(4):
                meta, positions = build_attention_metadata([[0, 1, 2, 3, 4]], [done], [new], BLOCK)
                logits = model.compute_logits(model(torch.tensor(ids), positions, caches, meta)[-1:])
                outs.append(logits)
                ids, done, new = [int(logits.argmax())], done + new, 1
        runs.append(outs)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
