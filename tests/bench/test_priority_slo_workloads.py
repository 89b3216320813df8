"""The priority and SLO-admission workloads of ``rooflm bench serve`` and their report fields, on hand-made
results (no timing)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from rooflm.bench import datasets, workloads
from rooflm.bench.serving import _validate, add_arguments, send_request

WINDOWS = datasets.TextWindows(" ".join(f"w{i}" for i in range(200)))


def test_priority_mix_places_the_high_priority_requests_after_the_first_quarter():
    reqs = datasets.priority_mix(20, WINDOWS, seed=1, num_high=4, input_len=8, output_len=5)
    assert reqs == datasets.priority_mix(20, WINDOWS, seed=1, num_high=4, input_len=8, output_len=5)
    high = [i for i, r in enumerate(reqs) if r.priority == datasets.HIGH_PRIORITY]
    assert high == [5, 8, 12, 16]  # 20 // 4 = 5, then every 15 / 4 requests
    assert all(r.priority == datasets.LOW_PRIORITY for i, r in enumerate(reqs) if i not in high)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(8, 5)}
    assert datasets.HIGH_PRIORITY < datasets.LOW_PRIORITY  # lower is served first
    # As many high-priority requests as there are after the first quarter: each its own.
    assert sum(r.priority == datasets.HIGH_PRIORITY for r in datasets.priority_mix(8, WINDOWS, num_high=6)) == 6
    for bad in (0, 7):
        with pytest.raises(ValueError, match=f"num_high={bad}"):
            datasets.priority_mix(8, WINDOWS, num_high=bad)


def test_idle_baseline_has_the_high_priority_lengths_but_other_prompts():
    reqs = datasets.priority_mix(12, WINDOWS, seed=0, num_high=3, input_len=20, output_len=7)
    idle = workloads.idle_requests(reqs, WINDOWS, seed=0)
    high = [r for r in reqs if r.priority == datasets.HIGH_PRIORITY]
    assert [(r.prompt_len, r.output_len, r.priority) for r in idle] == [
        (r.prompt_len, r.output_len, r.priority) for r in high]
    assert not {r.prompt for r in idle} & {r.prompt for r in reqs}  # no prefix-cache hit in the loaded run


@dataclass
class R:
    success: bool
    ttft: float
    error: str = ""


def test_priority_report_by_class_and_the_load_over_idle_ratio():
    reqs = [datasets.SampleRequest("p", 4, 4, priority=p) for p in (1, 0, 1, 0)]
    results = [R(True, 5.0), R(True, 0.2), R(False, 0.0, "HTTP 500"), R(True, 0.4)]
    idle = [R(True, 0.1), R(True, 0.2)]
    m = workloads.priority_report(results, reqs, idle)
    assert m["high"] == {"count": 2, "completed": 2, "mean_ttft_ms": pytest.approx(300.0),
                         "p50_ttft_ms": pytest.approx(300.0), "p99_ttft_ms": pytest.approx(398.0)}
    assert m["low"]["count"] == 2 and m["low"]["completed"] == 1 and m["low"]["p99_ttft_ms"] == 5000.0
    assert m["high_idle"]["p99_ttft_ms"] == pytest.approx(199.0)
    assert m["high_p99_ttft_load_over_idle"] == pytest.approx(398.0 / 199.0)
    assert "high_idle" not in workloads.priority_report(results, reqs, None)
    text = workloads.format_scheduling({"priority": m})
    assert "high, alone" in text and "2.00x" in text


REJECTED = R(False, 0.0, 'HTTP 503: {"error": {"code": "ttft_slo_unattainable"}}')


def test_slo_report_counts_rejections_apart_from_failures():
    results = [R(True, 0.5), R(True, 1.5), REJECTED, R(False, 0.0, "HTTP 500: boom"), REJECTED, R(True, 0.9)]
    m = workloads.slo_report(results, 1000.0)
    assert (m["requests"], m["admitted"], m["rejected"], m["failed_other"], m["met"]) == (6, 3, 2, 1, 2)
    assert m["attainment_admitted"] == pytest.approx(2 / 3) and m["attainment_all"] == pytest.approx(2 / 6)
    assert m["rejected_fraction"] == pytest.approx(2 / 6) and m["rejected_indices"] == [2, 4]


def test_counterfactual_reads_the_run_without_admission():
    m = workloads.slo_report([R(True, 0.5), REJECTED, REJECTED, REJECTED], 1000.0)
    baseline = {"ttfts": [0.4, 2.5, 0.8, 0.0], "errors": ["", "", "", "HTTP 500"]}
    c = workloads.counterfactual(m, baseline)
    # rejected 1: 2.5 s there (missed); 2: 0.8 s (would have met); 3: failed there (missed)
    assert c == {"rejected_would_miss": 2, "rejected_would_meet": 1, "rejected_would_miss_fraction": 2 / 3,
                 "baseline_attainment_all": 0.5}
    with pytest.raises(ValueError, match="same trace"):
        workloads.counterfactual(m, {"ttfts": [0.1], "errors": [""]})
    text = workloads.format_scheduling({"slo": {**m, **c}})
    assert "2 of 3" in text and "rejected (75.0%)" in text


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--base-url", "http://127.0.0.1:9", *argv])


def test_scheduling_sections_follow_the_flags(tmp_path):
    reqs = datasets.priority_mix(8, WINDOWS, num_high=2)
    results = [R(True, 0.1 * (i + 1)) for i in range(8)]
    assert workloads.scheduling_metrics(_args(), results, reqs, None, {}) == {}
    m = workloads.scheduling_metrics(_args("--dataset-name", "priority"), results, reqs, None, {"ttft": 350.0})
    assert set(m) == {"priority", "slo"} and m["slo"]["met"] == 3
    base = tmp_path / "base.json"
    base.write_text('{"ttfts": [0, 0, 0, 0, 0, 0, 0, 0], "errors": ["", "", "", "", "", "", "", ""]}')
    m = workloads.scheduling_metrics(_args("--compare-with", str(base)), results, reqs, None, {"ttft": 350.0})
    assert m["slo"]["rejected_would_miss"] == 0 and m["slo"]["baseline_attainment_all"] == 1.0
    with pytest.raises(ValueError, match="compare-with"):
        _validate(_args("--compare-with", str(base)))
    assert workloads.build_requests(_args("--dataset-name", "priority", "--num-prompts", "8",
                                          "--num-high-priority", "2", "--input-len", "6"), WINDOWS)[1] == \
        datasets.priority_mix(8, WINDOWS, num_high=2, input_len=6, output_len=32)


class _Stream:
    status_code = 200

    def __init__(self, sent: dict) -> None:
        self.sent = sent

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def aiter_lines(self):
        yield 'data: {"choices": [{"text": "x"}]}'
        yield "data: [DONE]"


class _Client:
    def __init__(self) -> None:
        self.sent: dict = {}

    def stream(self, method, url, json, headers):
        self.sent.update(json)
        return _Stream(self.sent)


def test_the_priority_field_is_sent_only_when_set():
    import asyncio

    for priority, expected in ((datasets.HIGH_PRIORITY, {"priority": 0}), (None, {})):
        c = _Client()
        asyncio.run(send_request(c, "u", {}, "m", datasets.SampleRequest("p", 1, 2, priority=priority),
                                 False, False, {}))
        assert {k: v for k, v in c.sent.items() if k == "priority"} == expected
