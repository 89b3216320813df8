"""Expert parallelism in the roofline: each GPU holds E/tp whole experts (``tiny_moe``: h=64, I=128, E=4, k=2)."""
from __future__ import annotations

import pytest
from roofline_helpers import round_hw, tiny, tiny_moe

from rooflm.roofline import analyze
from rooflm.roofline.ops import Dims


def test_each_gpu_holds_its_whole_experts():
    d = Dims.of(tiny_moe(), 2, expert_parallel=True)
    assert (d.inter, d.experts, d.ep) == (128, 4, 2)  # whole intermediate; the router still sees all 4 experts
    r = analyze(tiny_moe(), round_hw(), batch=1, input_len=8, output_len=1, tp=2, expert_parallel=True)
    # 2 layers · 3 projections · h·I · 2 experts per GPU · 2 B, plus the router 2 · h·E · 2 B
    assert r.memory.weights_breakdown["mlp"] == 2 * 3 * 64 * 128 * 2 * 2 + 2 * 64 * 4 * 2 == 197_632
    assert r.settings["expert_parallel"] is True


def test_decode_reads_half_the_touched_experts_per_gpu():
    one = analyze(tiny_moe(), round_hw(), batch=2, input_len=8, output_len=1)
    ep = analyze(tiny_moe(), round_hw(), batch=2, input_len=8, output_len=1, tp=2, expert_parallel=True)
    # T = 2 tokens: 3 experts touched in expectation, 1.5 of them per GPU, each with its whole h·I weights
    g1, g2 = one.decode.layer("gate_proj"), ep.decode.layer("gate_proj")
    assert g2.load_weight == 1.5 * 64 * 128 * 2 == g1.load_weight / 2
    assert g2.ops == 2 * (4 / 2) * 64 * 128 == g1.ops / 2  # R = T·k / ep = 2 routed rows per GPU
    assert ep.decode.layer("router").load_weight == one.decode.layer("router").load_weight
    assert ep.decode.layer("mlp_allreduce").comm_bytes > 0


def test_experts_that_do_not_split_over_the_gpus_are_refused():
    six = tiny(num_local_experts=6, num_experts_per_tok=2)
    analyze(six, round_hw(), tp=4)  # without it, I = 128 splits over 4
    with pytest.raises(ValueError, match=r"tp=4 is invalid.*num_local_experts=6"):
        analyze(six, round_hw(), tp=4, expert_parallel=True)


def test_the_report_says_expert_parallel():
    from rooflm.roofline import report

    ep = analyze(tiny_moe(), round_hw(), batch=1, input_len=8, output_len=2, tp=2, expert_parallel=True)
    assert "tp 2 expert-parallel (figures per GPU)" in report.text_report(ep)
    assert "expert-parallel" not in report.text_report(analyze(tiny_moe(), round_hw(), input_len=8, tp=2))
