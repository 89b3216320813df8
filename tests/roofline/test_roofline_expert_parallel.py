"""Expert parallelism in the roofline: each GPU holds E/tp whole experts (``tiny_moe``: h=64, I=128, E=4, k=2), and a
layer's time is that of the GPU whose experts the step touched most."""
from __future__ import annotations

import itertools

import pytest
from roofline_helpers import round_hw, tiny, tiny_moe

from rooflm.roofline import analyze
from rooflm.roofline.ops import Dims, expected_busiest_rank_experts, expected_distinct_experts


def test_each_gpu_holds_its_whole_experts():
    d = Dims.of(tiny_moe(), 2, expert_parallel=True)
    assert (d.inter, d.experts, d.ep) == (128, 4, 2)  # whole intermediate; the router still sees all 4 experts
    r = analyze(tiny_moe(), round_hw(), batch=1, input_len=8, output_len=1, tp=2, expert_parallel=True)
    # 2 layers · 3 projections · h·I · 2 experts per GPU · 2 B, plus the router 2 · h·E · 2 B
    assert r.memory.weights_breakdown["mlp"] == 2 * 3 * 64 * 128 * 2 * 2 + 2 * 64 * 4 * 2 == 197_632
    assert r.settings["expert_parallel"] is True


def _busiest_by_enumeration(experts: int, top_k: int, tokens: int, ep: int) -> float:
    """E[max over ranks of the distinct experts touched there], over every equally likely routing."""
    choices = list(itertools.combinations(range(experts), top_k))
    m = experts // ep
    total = 0
    for routing in itertools.product(choices, repeat=tokens):
        touched = set().union(*routing)
        total += max(sum(1 for e in touched if e // m == r) for r in range(ep))
    return total / len(choices) ** tokens


@pytest.mark.parametrize("experts,top_k,tokens,ep", [
    (8, 2, 1, 2), (8, 2, 2, 2), (8, 2, 3, 2), (4, 2, 2, 2), (8, 2, 2, 4), (6, 2, 2, 3), (8, 1, 3, 2), (8, 3, 2, 2),
    (8, 2, 2, 8)])
def test_the_busiest_rank_count_equals_enumerating_every_routing(experts, top_k, tokens, ep):
    got = expected_busiest_rank_experts(experts, top_k, tokens, ep)
    assert got == pytest.approx(_busiest_by_enumeration(experts, top_k, tokens, ep), rel=1e-12)
    assert got >= expected_distinct_experts(experts, top_k, tokens) / ep - 1e-12  # never below the even split


def test_the_busiest_rank_count_at_its_limits():
    assert expected_busiest_rank_experts(8, 2, 1, 2) == pytest.approx(1 + 3 / 7)  # Mixtral, one token, two GPUs
    assert expected_busiest_rank_experts(8, 2, 5, 1) == expected_distinct_experts(8, 2, 5)
    assert expected_busiest_rank_experts(8, 2, 10_000, 2) == pytest.approx(4)  # every expert touched
    # too many states to count exactly: the even split (a lower bound)
    assert expected_busiest_rank_experts(64, 8, 16, 8) == expected_distinct_experts(64, 8, 16) / 8


def test_decode_reads_the_busiest_gpus_touched_experts():
    one = analyze(tiny_moe(), round_hw(), batch=2, input_len=8, output_len=1)
    ep = analyze(tiny_moe(), round_hw(), batch=2, input_len=8, output_len=1, tp=2, expert_parallel=True)
    # T = 2 tokens of 4 experts, top-2: 3 experts touched in expectation, 1.5 per GPU on average, but the layer
    # waits for the GPU that touched more: 17/9 experts, each with its whole h·I weights
    g1, g2 = one.decode.layer("gate_proj"), ep.decode.layer("gate_proj")
    busiest = _busiest_by_enumeration(4, 2, 2, 2)
    assert busiest == pytest.approx(17 / 9)
    assert g1.load_weight == 3 * 64 * 128 * 2
    assert g2.load_weight == pytest.approx(busiest * 64 * 128 * 2)
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
