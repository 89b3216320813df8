"""One test per counting error of the public LLM-Viewer tool that rooflm does not repeat (issue 3, item 4).
Each asserts hand-computed values; the arithmetic is in the comments."""
from __future__ import annotations

import pytest

from rooflm.roofline import analyze, decode_step_time, prefill_time


def test_mlp_activation_is_sized_by_intermediate_not_hidden():
    # llama-2-7b: h = 4096, I = 11008. LLM-Viewer sized silu·up by h. Decode, batch 3: T = 3 tokens.
    # OPs 4 per element (exp, add, divide, multiply) · T·I = 4·3·11008 = 132,096
    # loads gate and up: 2·T·I·2 B = 132,096; stores T·I·2 B = 66,048
    r = analyze("llama-2-7b", "a6000", batch=3, input_len=64, output_len=1)
    act = r.decode.layer("mlp_act")
    assert (act.ops, act.load_act, act.store_act) == (132_096, 132_096, 66_048)
    # prefill, batch 3 x 64 tokens: T = 192 -> OPs 4·192·11008 = 8,454,144
    assert r.prefill.layer("mlp_act").ops == 8_454_144


def test_lm_head_counts_two_ops_per_mac_with_batch_and_sequence():
    # llama-2-7b: h = 4096, V = 32000. Prefill batch 2 x 16 tokens: T = 32.
    # OPs 2·T·h·V = 2·32·4096·32000 = 8,388,608,000 (LLM-Viewer: h·V = 131,072,000, no batch, no sequence)
    # loads W h·V·2 = 262,144,000 and x T·h·2 = 262,144; stores logits T·V·2 = 2,048,000
    r = analyze("llama-2-7b", "a6000", batch=2, input_len=16, output_len=1)
    lm = r.prefill.layer("lm_head")
    assert (lm.ops, lm.load_weight, lm.load_act, lm.store_act) == (8_388_608_000, 262_144_000, 262_144, 2_048_000)
    # decode batch 2: OPs 2·2·4096·32000 = 524,288,000; loads x 2·4096·2 = 16,384; stores 2·32000·2 = 128,000
    d = r.decode.layer("lm_head")
    assert (d.ops, d.load_act, d.store_act) == (524_288_000, 16_384, 128_000)
    # "last": an engine that computes logits only for the sampled positions: prefill N = batch = 2
    last = analyze("llama-2-7b", "a6000", batch=2, input_len=16, output_len=1, prefill_logits="last")
    assert last.prefill.layer("lm_head").ops == 524_288_000


def test_memory_counts_every_weight():
    # llama-2-7b parameters (known total 6,738,415,616):
    #   embedding 32000·4096 = 131,072,000; lm_head (untied) 131,072,000
    #   per layer: q,k,v,o 4·4096² = 67,108,864; MLP 3·4096·11008 = 135,266,304; 2 norms 8,192 -> 202,383,360 · 32
    #   final norm 4,096
    r = analyze("llama-2-7b", "a6000", batch=1, input_len=16, output_len=1)
    w = r.memory.weights_breakdown
    assert w["embedding"] == 131_072_000 * 2 and w["lm_head"] == 131_072_000 * 2
    assert w["norms"] == (2 * 32 + 1) * 4096 * 2
    assert r.memory.weights == 6_738_415_616 * 2
    # SmolLM2-135M ties lm_head to the embedding: counted once. Known total 134,515,008:
    #   emb 49152·576 = 28,311,552; per layer q,o 2·576² = 663,552, k,v 2·576·192 = 221,184,
    #   MLP 3·576·1536 = 2,654,208, norms 1,152 -> 3,540,096 · 30 = 106,202,880; final norm 576
    s = analyze("smollm2-135m", "a6000", batch=1, input_len=16, output_len=1)
    assert s.memory.weights_breakdown["lm_head"] == 0
    assert s.memory.weights == 134_515_008 * 2


def test_prefill_q_is_loaded_with_query_heads():
    # llama-3-8b: H = 32 query heads, Hk = 8 KV heads, d = 128. Prefill s = 128, batch 1, unfused.
    # qk_matmul loads Q: s·H·d·2 = 128·32·128·2 = 1,048,576 (LLM-Viewer used Hk: 262,144)
    #                 K: s·Hk·d·2 = 128·8·128·2 = 262,144
    r = analyze("llama-3-8b", "a6000", batch=1, input_len=128, output_len=1)
    qk = r.prefill.layer("qk_matmul")
    assert (qk.load_act, qk.load_kv) == (1_048_576, 262_144)


def test_fused_attention_loads_kv_with_kv_heads_and_is_not_slower_for_gqa_decode():
    # llama-3-8b decode, batch 1, context 4096, flash attention: K and V read once per KV head:
    # 2·4096·Hk·d·2 = 2·4096·8·128·2 = 16,777,216 bytes (LLM-Viewer used H = 32: 67,108,864)
    fused = analyze("llama-3-8b", "a6000", batch=1, input_len=4096, output_len=1, flash_attention=True)
    fa = fused.decode.layer("fused_attention")
    assert fa.load_kv == 16_777_216
    unfused = analyze("llama-3-8b", "a6000", batch=1, input_len=4096, output_len=1)
    t_unfused = sum(unfused.decode.layer(n).time_s for n in ("qk_matmul", "softmax", "sv_matmul"))
    assert fa.time_s < t_unfused
    assert fused.decode.time_s < unfused.decode.time_s


def test_fused_attention_output_is_sized_like_the_output_not_the_scores():
    # Output O is T·H·d·a. llama-2-7b prefill s = 512, batch 2: T = 1024 -> 1024·32·128·2 = 8,388,608 bytes
    # (LLM-Viewer: the score matrix b·H·s·s·2 = 2·32·512·512·2 = 33,554,432, twice)
    r = analyze("llama-2-7b", "a6000", batch=2, input_len=512, output_len=1, flash_attention=True)
    fa = r.prefill.layer("fused_attention")
    assert fa.store_act == 8_388_608
    # decode batch 2: 2·32·128·2 = 16,384
    assert r.decode.layer("fused_attention").store_act == 16_384


def test_request_totals_do_not_overwrite_prefill_and_memory_is_a_peak():
    # The whole request must not change the prefill stage, and memory is weights + final KV + peak activations
    # (LLM-Viewer's chat mode overwrote the prefill totals and summed memory over the decode steps).
    short = analyze("llama-2-7b", "a6000", batch=1, input_len=1024, output_len=1)
    long = analyze("llama-2-7b", "a6000", batch=1, input_len=1024, output_len=512)
    assert long.prefill.totals == short.prefill.totals
    assert long.decode.totals == short.decode.totals  # the reported decode step is at context = input_len
    # KV at the end: (1024 + 512 - 1) tokens · 32 layers · 2 · 32 heads · 128 · 2 B = 1535 · 524,288
    assert long.memory.kv_cache == 1535 * 524_288
    assert long.memory.total == long.memory.weights + long.memory.kv_cache + long.memory.peak_activation
    assert long.memory.total < long.memory.weights + 2 * long.memory.kv_cache  # no sum over steps
    # e2e = TTFT + Σ decode steps, step j attending to 1024 + j tokens (hand-summed for 3 generated tokens)
    r = analyze("llama-2-7b", "a6000", batch=1, input_len=1024, output_len=3)
    steps = [decode_step_time("llama-2-7b", "a6000", 1, 1024 + j) for j in (1, 2)]
    assert r.request.ttft_s == prefill_time("llama-2-7b", "a6000", 1, 1024)
    assert r.request.e2e_s == pytest.approx(r.request.ttft_s + sum(steps), rel=1e-12)
    assert r.request.tpot_s == pytest.approx(sum(steps) / 2, rel=1e-12)
    assert r.request.throughput_tok_s == pytest.approx(3 / r.request.e2e_s)
