"""LLM-Viewer (Yuan et al. 2024, "LLM Inference Unveiled") Table 1: LLaMA-2-7b on an NVIDIA A6000 (768 GB/s,
154.8 TFLOP/s fp16), sequence 2048, batch 1, fp16, no flash attention; the decode row is one step attending to
2048 tokens.

Tolerance: Table 1 prints 1-4 significant digits; each of our values must round to the printed figure at the printed
number of significant digits (``printed_matches``), e.g. 68.72G -> "69G", 8.39M -> "8M", 0.9918 -> "0.99"."""
from __future__ import annotations

import pytest
from roofline_helpers import printed_matches

from rooflm.roofline import analyze

# name: (OPs, memory access, arithmetic intensity, max performance, bound)   -- Table 1 of Yuan et al. 2024
PREFILL = {
    "q_proj": ("69G", "67M", "1024", "155T", "compute"),
    "k_proj": ("69G", "67M", "1024", "155T", "compute"),
    "v_proj": ("69G", "67M", "1024", "155T", "compute"),
    "o_proj": ("69G", "67M", "1024", "155T", "compute"),
    "gate_proj": ("185G", "152M", "1215", "155T", "compute"),
    "up_proj": ("185G", "152M", "1215", "155T", "compute"),
    "down_proj": ("185G", "152M", "1215", "155T", "compute"),
    "qk_matmul": ("34G", "302M", "114", "87T", "memory"),
    "sv_matmul": ("34G", "302M", "114", "87T", "memory"),
    "softmax": ("671M", "537M", "1.25", "960G", "memory"),
    "attn_norm": ("59M", "34M", "1.75", "1T", "memory"),
    "attn_add": ("8M", "34M", "0.25", "192G", "memory"),
}
DECODE = {
    "q_proj": ("34M", "34M", "1", "768G", "memory"),
    "k_proj": ("34M", "34M", "1", "768G", "memory"),
    "v_proj": ("34M", "34M", "1", "768G", "memory"),
    "o_proj": ("34M", "34M", "1", "768G", "memory"),
    "gate_proj": ("90M", "90M", "1", "768G", "memory"),
    "up_proj": ("90M", "90M", "1", "768G", "memory"),
    "down_proj": ("90M", "90M", "1", "768G", "memory"),
    "qk_matmul": ("17M", "17M", "0.99", "762G", "memory"),
    "sv_matmul": ("17M", "17M", "0.99", "762G", "memory"),
    "softmax": ("328K", "262K", "1.25", "960G", "memory"),
    "attn_norm": ("29K", "16K", "1.75", "1T", "memory"),
    "attn_add": ("4K", "16K", "0.25", "192G", "memory"),
}
# Table 1's norm and add rows follow LLM-Viewer's element-wise counting (norm weight not loaded, the residual add
# reading one input); ``llm_viewer_elementwise=True`` reproduces it. Every other row is the same in both modes.
ELEMENTWISE = {"attn_norm", "attn_add"}


@pytest.fixture(scope="module")
def table1():
    return analyze("llama-2-7b", "a6000", batch=1, input_len=2048, output_len=1, llm_viewer_elementwise=True)


@pytest.fixture(scope="module")
def default():
    return analyze("llama-2-7b", "a6000", batch=1, input_len=2048, output_len=1)


def test_a6000_is_the_papers_device(table1):
    hw = table1.hardware
    assert hw.memory_bandwidth == 768e9
    assert hw.peak("fp16") == pytest.approx(154.8e12)


@pytest.mark.parametrize("stage,rows", [("prefill", PREFILL), ("decode", DECODE)])
def test_table1_rows(table1, default, stage, rows):
    for name, (ops, mem, ai, perf, bound) in rows.items():
        for result in (table1,) if name in ELEMENTWISE else (table1, default):
            r = result.stages[stage].layer(name)
            got = (r.ops, r.memory_access, r.arithmetic_intensity, r.performance)
            for value, printed in zip(got, (ops, mem, ai, perf)):
                assert printed_matches(value, printed), (stage, name, value, printed)
            assert r.bound == bound, (stage, name)
    # mlp_norm / mlp_add are the same operators as attn_norm / attn_add
    for a, b in (("attn_norm", "mlp_norm"), ("attn_add", "mlp_add")):
        assert table1.stages[stage].layer(a).memory_access == table1.stages[stage].layer(b).memory_access


def test_table1_exact_arithmetic(table1):
    # prefill q_proj: 2·s·h·h = 2·2048·4096·4096 = 68,719,476,736 OPs;
    # bytes: weight 4096·4096·2 = 33,554,432 + in 2048·4096·2 = 16,777,216 + out 16,777,216 = 67,108,864 -> AI 1024
    q = table1.prefill.layer("q_proj")
    assert q.ops == 68_719_476_736 and q.memory_access == 67_108_864 and q.arithmetic_intensity == 1024
    # prefill qk_matmul: 2·H·s·s·d = 2·32·2048·2048·128 = 34,359,738,368; bytes: Q 16,777,216 + K 16,777,216
    # + scores 32·2048·2048·2 = 268,435,456 -> 301,989,888
    qk = table1.prefill.layer("qk_matmul")
    assert qk.ops == 34_359_738_368 and qk.memory_access == 301_989_888
    # decode qk_matmul: 2·H·1·2048·d = 16,777,216; bytes: Q 8,192 + K 2048·4096·2 = 16,777,216 + scores 131,072
    dqk = table1.decode.layer("qk_matmul")
    assert dqk.ops == 16_777_216 and dqk.memory_access == 8_192 + 16_777_216 + 131_072


def test_default_elementwise_counts_weight_and_both_inputs(default):
    # RMSNorm decode: OPs 7·h = 28,672; loads x (4096·2) and its weight (4096·2), stores 4096·2 -> 24,576 bytes
    n = default.decode.layer("attn_norm")
    assert (n.ops, n.load_act, n.load_weight, n.store_act) == (28_672, 8_192, 8_192, 8_192)
    # residual add decode: OPs h = 4096; loads both inputs (2·8192), stores 8192 -> 24,576 bytes, AI 1/6
    a = default.decode.layer("attn_add")
    assert (a.ops, a.memory_access) == (4_096, 24_576)
    assert a.arithmetic_intensity == pytest.approx(4096 / 24576)
