"""`rooflm bench serve` against a server: the fake one in-process (fast, exact counts) and `rooflm serve` with the
default model in a subprocess (the acceptance run: a report and a JSON result file)."""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys

import pytest
from server_helpers import API_KEY, FakeServer, ServerProcess

from rooflm.bench.serving import add_arguments, run

KEYS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
        "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
        "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "request_goodput", "duration", "input_lens",
        "output_lens", "ttfts", "itls", "errors")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_bench_against_the_fake_server_fixed_lengths(shared_fake_server: FakeServer, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = run(_args("--base-url", shared_fake_server.url, "--api-key", API_KEY, "--num-prompts", "12",
                   "--input-len", "20", "--output-len", "6", "--ignore-eos", "--max-concurrency", "4",
                   "--goodput", "ttft:60000", "tpot:60000", "--result-file", str(out)))
    assert rc == 0
    report = capsys.readouterr().out
    assert "Serving Benchmark Result" in report and "Maximum request concurrency:" in report
    r = json.loads(out.read_text())
    assert all(k in r for k in KEYS)
    assert r["completed"] == 12 and r["failed"] == 0 and r["dataset_name"] == "fixed"
    assert r["total_output_tokens"] == 12 * 6  # counted by the server's usage
    # The fake tokenizer is byte-level (~5.5 tokens a word): /tokenize calibrated the ratio, so prompts average
    # about 20 tokens (4 words of varying length each).
    assert 12 <= sum(r["input_lens"]) / 12 <= 30 and r["tokens_per_word"] > 4
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert all(0 < t for t in r["ttfts"])


def test_bench_against_the_fake_server_sharegpt_like_poisson(shared_fake_server: FakeServer, tmp_path, capsys):
    rc = run(_args("--base-url", shared_fake_server.url + "/v1", "--api-key", API_KEY, "--num-prompts", "10",
                   "--mean-input-len", "30", "--mean-output-len", "8", "--max-input-len", "100",
                   "--max-output-len", "20", "--request-rate", "50", "--endpoint", "/v1/chat/completions",
                   "--json", "-", "--csv", str(tmp_path / "r.csv")))
    assert rc == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)  # stdout holds the JSON alone; the report went to stderr
    assert "Serving Benchmark Result" in captured.err
    row = next(csv.DictReader((tmp_path / "r.csv").open()))
    for key in ("completed", "request_throughput", "output_throughput", "mean_ttft_ms", "p99_e2el_ms"):
        assert float(row[key]) == pytest.approx(float(r[key]))
    assert "ttfts" not in row  # per-request lists stay in the JSON
    assert r["completed"] == 10 and r["dataset_name"] == "sharegpt-like" and r["backend"] == "openai-chat"
    assert r["request_rate"] == 50


def test_bench_reports_failures_without_crashing(shared_fake_server: FakeServer, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = run(_args("--base-url", shared_fake_server.url, "--api-key", "wrong", "--model", "fake-model",
                   "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--result-file", str(out)))
    assert rc == 1 and "initial test request" in capsys.readouterr().err
    rc = run(_args("--base-url", shared_fake_server.url, "--api-key", "wrong", "--model", "fake-model",
                   "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--no-warmup",
                   "--result-file", str(out)))
    r = json.loads(out.read_text())
    assert rc == 1 and r["completed"] == 0 and r["failed"] == 2 and "401" in r["errors"][0]


@pytest.mark.slow
def test_rooflm_bench_serve_against_rooflm_serve(real_server: ServerProcess, tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "rooflm.cli", "bench", "serve", "--base-url", real_server.url or "",
           "--api-key", API_KEY, "--num-prompts", "12", "--mean-input-len", "48", "--mean-output-len", "8",
           "--max-output-len", "16", "--request-rate", "8", "--ignore-eos", "--goodput", "ttft:30000",
           "--result-file", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Mean TTFT (ms):" in proc.stdout
    r = json.loads(out.read_text())
    assert all(k in r for k in KEYS)
    assert r["completed"] == 12 and r["failed"] == 0
    assert r["total_output_tokens"] == sum(r["output_lens"]) and r["total_input_tokens"] > 0
    assert r["mean_ttft_ms"] > 0 and r["mean_itl_ms"] > 0 and r["output_throughput"] > 0
    assert 0.5 < r["tokens_per_word"] < 3  # measured with the server's /tokenize
