"""The serving benchmark's pieces: the workload distribution and the metrics (no server needed)."""
from __future__ import annotations

import argparse
import math
import random
import statistics

import pytest

from rooflm.bench import datasets
from rooflm.bench.clients import percentile as _percentile
from rooflm.bench.serving import (
    RequestResult,
    _validate,
    add_arguments,
    compute_metrics,
    format_report,
    parse_goodput,
)


def test_clipped_lognormal_mean_matches_monte_carlo():
    rng = random.Random(0)
    mu, sigma, lo, hi = 4.8, 1.0, 4, 1024
    xs = [min(max(rng.lognormvariate(mu, sigma), lo), hi) for _ in range(200_000)]
    assert datasets.clipped_lognormal_mean(mu, sigma, lo, hi) == pytest.approx(statistics.fmean(xs), rel=0.01)


@pytest.mark.parametrize("mean,sigma", [(200, 1.0), (180, 0.8), (20, 0.5)])
def test_sampled_lengths_have_the_target_mean_within_the_clip(mean: float, sigma: float):
    xs = datasets.sample_lengths(random.Random(1), 40_000, mean, sigma)
    assert statistics.fmean(xs) == pytest.approx(mean, rel=0.03)
    assert min(xs) >= datasets.MIN_LEN and max(xs) <= datasets.MAX_LEN
    assert statistics.median(xs) < mean  # right-skewed, like chat traffic


def test_mean_outside_the_clip_is_rejected():
    with pytest.raises(ValueError, match="strictly between"):
        datasets.lognormal_mu_for_mean(2000, 1.0, 4, 1024)


def test_sharegpt_like_workload_is_deterministic_and_sized():
    text = datasets.load_text()
    assert len(text.split()) > 10_000
    windows = datasets.TextWindows(text, tokens_per_word=1.25)
    a = datasets.sharegpt_like(300, windows, seed=7)
    b = datasets.sharegpt_like(300, windows, seed=7)
    assert a == b and len(a) == 300
    assert statistics.fmean(r.prompt_len for r in a) == pytest.approx(200, rel=0.2)
    assert statistics.fmean(r.output_len for r in a) == pytest.approx(180, rel=0.2)
    for r in a[:50]:
        assert len(r.prompt.split()) == max(1, round(r.prompt_len / 1.25))
        assert r.prompt in " ".join(text.split()) or len(r.prompt.split()) >= len(text.split())


def test_fixed_lengths_and_custom_text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                    "sixteen seventeen")
    windows = datasets.TextWindows(datasets.load_text(str(path)), tokens_per_word=1.0)
    reqs = datasets.fixed_lengths(5, windows, input_len=40, output_len=3)  # longer than the text: wraps around
    assert all(r.prompt_len == 40 and r.output_len == 3 and len(r.prompt.split()) == 40 for r in reqs)
    path.write_text("too short")
    with pytest.raises(ValueError, match="fewer than 16 words"):
        datasets.load_text(str(path))


def _result(ttft: float, latency: float, out: int, prompt: int = 10, itl: list[float] | None = None) -> RequestResult:
    return RequestResult(success=True, prompt_len=prompt, output_len=out, ttft=ttft, latency=latency,
                         itl=itl if itl is not None else [(latency - ttft) / max(out - 1, 1)] * (out - 1))


def test_compute_metrics_by_hand():
    results = [
        _result(0.1, 1.1, 11),  # tpot 100 ms
        _result(0.3, 2.3, 21),  # tpot 100 ms
        _result(0.2, 0.2, 1),  # one token: no TPOT
        RequestResult(success=False, error="HTTP 500"),
    ]
    m = compute_metrics(results, duration=2.0, percentiles=[50, 99], goodput={"ttft": 250, "tpot": 150})
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 33
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(16.5)
    assert m["total_token_throughput"] == pytest.approx(31.5)
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(298, rel=1e-6)
    assert m["mean_tpot_ms"] == pytest.approx(100) and m["mean_itl_ms"] == pytest.approx(100)
    assert m["mean_e2el_ms"] == pytest.approx((1100 + 2300 + 200) / 3)
    assert m["request_goodput"] == pytest.approx(1.0)  # the 300 ms TTFT request misses the SLO
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99", "p50"):
            assert f"{stat}_{name}_ms" in m


def test_percentile_interpolates_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert _percentile(xs, 50) == 2.5 and _percentile(xs, 0) == 1.0 and _percentile(xs, 100) == 4.0
    assert _percentile(xs, 99) == pytest.approx(3.97)
    assert _percentile([], 99) == 0.0


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:1e4"]) == {"ttft": 500, "tpot": 50, "e2el": 10000}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_report_uses_vllm_names():
    m = compute_metrics([_result(0.1, 1.1, 11)], 1.0, [99], {"e2el": 2000})
    text = format_report(m, [99], {"e2el": 2000}, math.inf, 4)
    for line in ("Serving Benchmark Result", "Successful requests:", "Failed requests:",
                 "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                 "Request throughput (req/s):", "Request goodput (req/s):", "Output token throughput (tok/s):",
                 "Total Token throughput (tok/s):", "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):",
                 "Mean E2EL (ms):", "Maximum request concurrency:"):
        assert line in text, line


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--base-url", "http://127.0.0.1:9", *argv])


@pytest.mark.parametrize("argv,match", [
    (["--num-prompts", "0"], "num-prompts"), (["--request-rate", "0"], "request-rate"),
    (["--max-concurrency", "0"], "max-concurrency"), (["--input-len", "0"], "input-len"),
    (["--extra-body", "[1]"], "extra-body"), (["--goodput", "x:1"], "goodput"),
    (["--metric-percentiles", "a,b"], "metric-percentiles"), (["--burstiness", "-1"], "burstiness"),
])
def test_invalid_options_are_reported(argv: list[str], match: str):
    with pytest.raises(ValueError, match=match):
        _validate(_args(*argv))


def test_unreachable_server_is_a_clean_error(capsys):
    from rooflm.bench.serving import run

    assert run(_args("--num-prompts", "1", "--request-timeout", "5", "--model", "m")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("rooflm bench serve: error: ") and err.count("\n") == 0
    assert "Error:" not in err and "Exception" not in err  # the reason, not an exception class name
