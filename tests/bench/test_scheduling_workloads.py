"""The scheduling workloads of ``rooflm bench serve`` and the per-client report, checked by hand."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from rooflm.bench import datasets
from rooflm.bench.clients import format_clients, jct_stats, per_client_metrics

WINDOWS = datasets.TextWindows("one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
                               "fifteen sixteen seventeen")


def test_heavy_tailed_outputs_are_deterministic_bounded_and_heavy_tailed():
    a = datasets.heavy_tailed(400, WINDOWS, seed=3, max_output_len=512)
    assert a == datasets.heavy_tailed(400, WINDOWS, seed=3, max_output_len=512)
    outs = sorted(r.output_len for r in a)
    assert outs[0] >= datasets.HEAVY_TAIL_MIN_OUTPUT and outs[-1] <= 512
    # The longest tenth of the requests holds far more than a tenth of the output tokens.
    assert sum(outs[-40:]) > 0.4 * sum(outs)
    assert outs[len(outs) // 2] < sum(outs) / len(outs)  # median below the mean: a right tail


def test_pareto_lengths_reject_bad_parameters():
    with pytest.raises(ValueError, match="alpha=0"):
        datasets.pareto_lengths(random.Random(0), 3, 8, 0, 100)
    with pytest.raises(ValueError, match="x_min=0"):
        datasets.pareto_lengths(random.Random(0), 3, 0, 1.1, 100)


def test_multi_client_sends_the_heavy_client_first_then_the_light_ones_round_robin():
    reqs = datasets.multi_client(10, WINDOWS, num_light=3, heavy_fraction=0.6, input_len=8, output_len=5)
    assert [r.user for r in reqs] == ["heavy"] * 6 + ["light-1", "light-2", "light-3", "light-1"]
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(8, 5)}
    with pytest.raises(ValueError, match="num_light=0"):
        datasets.multi_client(10, WINDOWS, num_light=0)


@dataclass
class R:
    user: str | None
    start: float
    ttft: float
    latency: float
    prompt_len: int
    output_len: int
    itl: list[float] = field(default_factory=list)
    success: bool = True


def test_per_client_service_is_counted_over_the_backlogged_window():
    results = [
        # heavy: two requests, the second still streaming when light finishes at t = 3.
        R("heavy", 0.0, 0.5, 2.0, 10, 4, [0.5, 0.5, 0.5]),  # chunks at 0.5, 1.0, 1.5, 2.0: all inside
        R("heavy", 0.0, 2.0, 6.0, 10, 4, [0.5, 1.0, 2.5]),  # chunks at 2.0, 2.5, 3.5, 6.0: 2 of 4 inside
        R("light", 0.5, 1.0, 2.5, 6, 2, [1.5]),  # chunks at 1.5, 3.0: both inside; it ends the window at 3.0
    ]
    m = per_client_metrics(results, w_in=1.0, w_out=2.0)
    assert m["window_s"] == 3.0
    heavy = (10 + 2 * 4) + (10 + 2 * 4 * 2 / 4)
    light = 6 + 2 * 2
    assert m["clients"]["heavy"]["service"] == heavy and m["clients"]["light"]["service"] == light
    assert m["clients"]["light"]["share"] == light / (heavy + light)
    assert m["light_heavy_service_ratio"] == light / heavy
    assert m["clients"]["heavy"]["mean_jct_ms"] == 4000.0 and m["clients"]["heavy"]["p50_jct_ms"] == 4000.0
    assert "light" in format_clients(m)


def test_results_without_clients_have_no_per_client_report():
    assert per_client_metrics([R(None, 0.0, 0.1, 1.0, 3, 3)]) == {}


def test_jct_percentiles_interpolate():
    s = jct_stats([1.0, 2.0, 3.0, 4.0])
    assert s["mean_jct_ms"] == 2500.0 and s["p50_jct_ms"] == 2500.0 and s["p99_jct_ms"] == pytest.approx(3970.0)
