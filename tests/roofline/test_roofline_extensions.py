"""Beyond LLM-Viewer (issue 3, item 5): GQA, sliding windows, MoE, tensor parallelism, quantization, KV bits and
causal masking, against hand-computed values on small configs. ``tiny``: h=64, I=128, H=4, Hk=2, d=16, 2 layers,
V=100. ``round_hw``: 100 GB/s, 10 TFLOP/s fp16, 50 GB/s interconnect."""
from __future__ import annotations

import pytest
from roofline_helpers import round_hw, tiny, tiny_moe

from rooflm.roofline import analyze
from rooflm.roofline.ops import causal_pairs, expected_distinct_experts


# --- MoE -------------------------------------------------------------------------------------------------------------
def test_expected_distinct_experts():
    # E·(1 - (1 - k/E)^T): E=4, k=2: T=1 -> 2 (exactly k); T=2 -> 4·(1 - 1/4) = 3; T=8 -> 4·(1 - 1/256) = 3.984375
    assert expected_distinct_experts(4, 2, 1) == 2
    assert expected_distinct_experts(4, 2, 2) == 3
    assert expected_distinct_experts(4, 2, 8) == 3.984375
    # Mixtral (E=8, k=2), 1 token: 2 experts; many tokens: all 8
    assert expected_distinct_experts(8, 2, 1) == 2
    assert expected_distinct_experts(8, 2, 1000) == pytest.approx(8)


def test_moe_decode_rows():
    r = analyze(tiny_moe(), round_hw(), batch=2, input_len=8, output_len=1)
    # T = 2 tokens, R = T·k = 4 routed rows, expected distinct experts 3 (above)
    g = r.decode.layer("gate_proj")
    assert g.ops == 2 * 4 * 64 * 128 == 65_536
    assert g.load_weight == 3 * 64 * 128 * 2 == 49_152  # 3 experts' h·I weights, 2 B each
    assert (g.load_act, g.store_act) == (4 * 64 * 2, 4 * 128 * 2)  # 512, 1024
    # memory-bound: (49,152 + 512 + 1,024) B / 100 GB/s = 506.88 ns  >  65,536 / 10 TOP/s = 6.55 ns
    assert g.bound == "memory" and g.time_s == pytest.approx(50_688 / 100e9)
    router = r.decode.layer("router")  # 2·T·h·E = 2·2·64·4 = 1024 OPs; weights h·E·2 B = 512; logits T·E·2 B = 16
    assert (router.ops, router.load_weight, router.store_act) == (1_024, 512, 16)
    comb = r.decode.layer("expert_combine")  # 2·R·h = 512 OPs; loads R·h·2 = 512 B; stores T·h·2 = 256 B
    assert (comb.ops, comb.load_act, comb.store_act) == (512, 512, 256)
    # batch 1: exactly k = 2 experts' weights: 2·64·128·2 = 32,768 B
    one = analyze(tiny_moe(), round_hw(), batch=1, input_len=8, output_len=1)
    assert one.decode.layer("down_proj").load_weight == 32_768
    # prefill of 8 tokens: 3.984375 experts · 16,384 B = 65,280 B
    assert one.prefill.layer("up_proj").load_weight == 65_280


def test_moe_memory_holds_all_experts():
    r = analyze(tiny_moe(), round_hw(), batch=1, input_len=8, output_len=1)
    # 2 layers · 3 projections · 64·128 · 4 experts · 2 B = 393,216, + router 2 layers · 64·4 · 2 B = 1,024
    assert r.memory.weights_breakdown["mlp"] == 394_240


def test_mixtral_decode_reads_two_of_eight_experts():
    r = analyze("mixtral-8x7b", "h100-sxm", batch=1, input_len=512, output_len=1)
    # batch 1: 2 experts · 4096·14336 · 2 B = 234,881,024 per projection
    assert r.decode.layer("gate_proj").load_weight == 2 * 4096 * 14336 * 2


# --- tensor parallelism ----------------------------------------------------------------------------------------------
def test_tp_shards_and_allreduce_time():
    r = analyze(tiny(), round_hw(), batch=1, input_len=8, output_len=1, tp=2)
    # per GPU: H = 2, Hk = 1, I = 64. q_proj decode: 2·1·64·(2·16) = 4,096 OPs; weight 64·32·2 B = 4,096 B
    q = r.decode.layer("q_proj")
    assert (q.ops, q.load_weight) == (4_096, 4_096)
    assert r.decode.layer("gate_proj").ops == 2 * 64 * 64
    # ring all-reduce of T·h·2 B = 128 B: each GPU sends 2·(2-1)/2·128 = 128 B; 128 B / 50 GB/s = 2.56 ns
    ar = r.decode.layer("attn_allreduce")
    assert (ar.comm_bytes, ar.bound) == (128, "comm") and ar.time_s == pytest.approx(2.56e-9)
    # logits all-gather: (2-1)/2 · 1·100·2 B = 100 B -> 2 ns
    assert r.decode.layer("logits_allgather").time_s == pytest.approx(2e-9)
    # comm time: 2 layers · 2 all-reduces · 2.56 ns + embedding all-reduce 2.56 ns + all-gather 2 ns = 14.8 ns
    assert r.decode.totals.time_comm_s == pytest.approx(14.8e-9)
    # weights per GPU: embedding 50·64·2 = 6,400, lm_head 6,400, attention 2·(64·32 + 2·64·16 + 32·64)·2 = 24,576,
    # MLP 2·3·64·64·2 = 49,152, norms (2·2+1)·64·2 = 640 -> 87,168 (tp=1: 173,696)
    assert r.memory.weights == 87_168
    assert analyze(tiny(), round_hw(), batch=1, input_len=8, output_len=1).memory.weights == 173_696
    # KV per GPU: 1 KV head: b·tokens·layers·2·1·16·2 B = 8 tokens -> 1,024
    assert r.memory.kv_cache == 8 * 2 * 2 * 1 * 16 * 2


def test_tp_replicates_kv_heads_and_rejects_bad_degrees():
    r = analyze(tiny(), round_hw(), batch=1, input_len=8, output_len=1, tp=4)  # Hk = 2 < 4: one KV head per GPU
    assert r.decode.layer("k_proj").load_weight == 64 * 16 * 2
    with pytest.raises(ValueError, match=r"tp=3 is invalid.*\[1, 2, 4\]"):
        analyze(tiny(), round_hw(), tp=3)
    with pytest.raises(ValueError, match="interconnect"):
        analyze(tiny(), round_hw(ic_gbs=None), batch=1, input_len=8, output_len=1, tp=2)


# --- quantization --------------------------------------------------------------------------------------------------
def test_weight_only_quantization_keeps_fp16_peak_and_reports_dequant():
    r = analyze("llama-2-7b", "a6000", batch=1, input_len=2048, output_len=1, w_bits=4)
    q = r.decode.layer("q_proj")
    assert q.ops == 2 * 4096 * 4096  # OPs unchanged
    assert q.load_weight == 4096 * 4096 * 0.5 == 8_388_608
    assert q.compute_dtype == "fp16" and q.dequant_ops == 2 * 4096 * 4096
    p = r.prefill.layer("q_proj")  # compute-bound at the fp16 peak: 68,719,476,736 / 154.8e12
    assert p.bound == "compute" and p.time_s == pytest.approx(68_719_476_736 / 154.8e12)
    # embeddings and lm_head stay 16-bit
    assert r.decode.layer("lm_head").load_weight == 4096 * 32000 * 2


def test_low_precision_peaks_need_both_operands():
    w8a8 = analyze("llama-2-7b", "a6000", batch=1, input_len=2048, output_len=1, w_bits=8, a_bits=8)
    p = w8a8.prefill.layer("q_proj")
    # int8·int8 -> int8 peak 309.7 TOP/s: 68,719,476,736 / 309.7e12; nothing converted
    assert p.compute_dtype == "int8" and p.dequant_ops == 0
    assert p.time_s == pytest.approx(68_719_476_736 / 309.7e12)
    assert analyze("llama-2-7b", "h100-sxm", input_len=64, output_len=1, w_bits="fp8",
                   a_bits="fp8").prefill.layer("q_proj").compute_dtype == "fp8"
    # the A6000 has no fp8 units: fp8 operands are converted to fp16, and the conversion is reported
    a6 = analyze("llama-2-7b", "a6000", input_len=64, output_len=1, w_bits="fp8", a_bits="fp8").prefill.layer("q_proj")
    assert a6.compute_dtype == "fp16" and a6.dequant_ops == 2 * 4096 * 4096
    # W8A16: int8 weights with fp16 activations run at the fp16 peak
    assert analyze("llama-2-7b", "a6000", input_len=64, output_len=1, w_bits=8).prefill.layer(
        "q_proj").compute_dtype == "fp16"
    # int4·int4 on the H100 (no int4 units): int8 peak
    assert analyze("llama-2-7b", "h100-sxm", input_len=64, output_len=1, w_bits=4, a_bits=4).prefill.layer(
        "q_proj").compute_dtype == "int8"


def test_kv_bits():
    r = analyze("llama-2-7b", "a6000", batch=1, input_len=2048, output_len=1, kv_bits=8)
    qk = r.decode.layer("qk_matmul")
    assert qk.load_kv == 2048 * 4096 * 1 == 8_388_608  # K at 1 B per element
    assert qk.compute_dtype == "fp16" and qk.dequant_ops == 2 * 2048 * 4096
    # KV memory: 2048 tokens · 32 layers · 2 · 4096 · 1 B
    assert r.memory.kv_cache == 2048 * 32 * 2 * 4096


# --- GQA, sliding windows, causal masking ----------------------------------------------------------------------------
def test_gqa_kv_sizes():
    r = analyze("llama-3-8b", "a6000", batch=1, input_len=1000, output_len=1)
    # Hk = 8: k_proj weight 4096·1024·2 B; v_proj writes 1024·2 B per token to the cache
    assert r.decode.layer("k_proj").load_weight == 4096 * 1024 * 2
    assert r.decode.layer("v_proj").store_kv == 1024 * 2
    # KV per token: 32 layers · 2 · 8 · 128 · 2 B = 131,072
    assert r.memory.kv_cache == 1000 * 131_072


def test_sliding_window():
    cfg = tiny(sliding_window=4)
    r = analyze(cfg, round_hw(), batch=1, input_len=10, output_len=1, flash_attention=True)
    # decode at context 10 reads only the last 4 keys: K and V 2·4·Hk·d·2 B = 2·4·2·16·2 = 512
    assert r.decode.layer("fused_attention").load_kv == 512
    # cache keeps 4 tokens: 4 · 2 layers · 2 · 2 · 16 · 2 B = 1,024
    assert r.memory.kv_cache == 1_024 and r.memory.kv_cache_tokens == 4
    # fused prefill of 10 tokens: pairs Σ min(i, 4) = 4·5/2 + 6·4 = 34; OPs b·H·pairs·(4d+5) = 4·34·69 = 9,384
    assert causal_pairs(10, 4) == 34
    assert r.prefill.layer("fused_attention").ops == 9_384
    # decode steps past the window cost the same
    long = analyze(cfg, round_hw(), batch=1, input_len=10, output_len=6, flash_attention=True)
    assert long.request.tpot_s == pytest.approx(r.decode.time_s)


def test_causal_masking_fused_skips_half_unfused_computes_all():
    fused = analyze(tiny(), round_hw(), batch=1, input_len=10, output_len=1, flash_attention=True)
    # causal pairs 10·11/2 = 55 -> OPs 4 heads · 55 · (4·16 + 5) = 15,180
    assert fused.prefill.layer("fused_attention").ops == 15_180
    un = analyze(tiny(), round_hw(), batch=1, input_len=10, output_len=1)
    # full 10×10 scores per head: qk 2·4·100·16 = 12,800; softmax 5·400 = 2,000; sv 12,800
    assert [un.prefill.layer(n).ops for n in ("qk_matmul", "softmax", "sv_matmul")] == [12_800, 2_000, 12_800]


# --- input errors --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,msg", [
    (dict(batch=0), r"batch=0 is invalid: expected an integer >= 1"),
    (dict(input_len=-1), r"input_len=-1 is invalid"),
    (dict(w_bits=3), r"w_bits=3 is invalid: expected one of 32, 16, bf16, 8, fp8, 4"),
    (dict(kv_bits="int2"), r"kv_bits='int2' is invalid"),
    (dict(prefill_logits="some"), r"prefill_logits='some' is invalid"),
])
def test_bad_input_names_field_and_accepted_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        analyze(tiny(), round_hw(), **kw)


def test_unknown_hardware_lists_catalog():
    with pytest.raises(ValueError, match=r"hardware='a600' is unknown: expected one of .*a6000.*h100-sxm"):
        analyze(tiny(), "a600")


def test_speculative_prediction_follows_the_roofline():
    """Memory-bound batch 1: a verify step costs about one decode step, so the speed-up approaches the tokens per
    verification; at a compute-bound batch the verify step costs its tokens and speculation loses."""
    import re

    from rooflm.roofline.cli import speculative_lines
    from rooflm.roofline.hardware import get_hardware
    from rooflm.spec_decode.proposer import expected_tokens

    hw = get_hardware("a6000")
    (small,) = speculative_lines("llama-2-7b", hw, [1], 1024, 4, 0.8)
    ratio, speedup = (float(x) for x in re.search(r"= ([\d.]+)x a decode.*speed-up ([\d.]+)x", small).groups())
    assert 1.0 <= ratio < 1.05
    assert speedup == pytest.approx(expected_tokens(4, 0.8) / ratio, rel=1e-2)
    (big,) = speculative_lines("llama-2-7b", hw, [1024], 16, 4, 0.5)  # short contexts: the linear layers dominate
    ratio_big, speedup_big = (float(x) for x in re.search(r"= ([\d.]+)x a decode.*speed-up ([\d.]+)x", big).groups())
    assert ratio_big > 2.0 and speedup_big < 1.0
    with pytest.raises(ValueError, match="--acceptance"):
        speculative_lines("llama-2-7b", hw, [1], 1024, 4, 1.5)
