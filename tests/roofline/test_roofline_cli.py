"""``rooflm analyze``: table, JSON schema, CSV, sweeps, one-line errors, no heavy imports."""
from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys

import pytest

from rooflm.roofline.cli import register


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="rooflm")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["analyze", *argv])
    rc = args.func(args)
    return rc, capsys.readouterr().out


def test_table(capsys):
    rc, out = run_cli(["llama-2-7b", "--hardware", "a6000", "--batch", "1", "--input-len", "2048"], capsys)
    assert rc == 0
    for text in ("Prefill: batch 1, 2048 prompt tokens", "Decode: batch 1", "q_proj", "qk_matmul", "lm_head",
                 "total (32 blocks + model)", "Memory per GPU", "TTFT", "TPOT"):
        assert text in out
    q_proj = next(line for line in out.splitlines() if line.startswith("q_proj"))
    assert "68.7G" in q_proj and "67.1M" in q_proj and "compute" in q_proj  # Table 1: 69G, 67M, compute


def test_json_schema(capsys):
    rc, out = run_cli(["llama-2-7b", "--input-len", "512", "--output-len", "4", "--json"], capsys)
    d = json.loads(out)
    assert set(d) >= {"model", "hardware", "settings", "stages", "memory", "request"}
    assert set(d["stages"]) == {"prefill", "decode"}
    layer = d["stages"]["prefill"]["layers"][0]
    for key in ("name", "ops", "bytes_loaded", "bytes_stored", "memory_access", "arithmetic_intensity",
                "performance", "bound", "time_s"):
        assert key in layer
    assert layer["memory_access"] == layer["bytes_loaded"] + layer["bytes_stored"]
    assert d["stages"]["decode"]["totals"]["time_s"] > 0
    assert set(d["memory"]) >= {"weights", "kv_cache", "peak_activation", "total", "fits"}
    assert set(d["request"]) >= {"ttft_s", "tpot_s", "e2e_s", "throughput_tok_s"}
    assert d["request"]["decode_steps"] == 3


def test_csv_and_sweep(capsys, tmp_path):
    rc, out = run_cli(["llama-2-7b", "--batch", "1,4", "--input-len", "128,256", "--w-bits", "16,4"], capsys)
    lines = [x for x in out.splitlines() if x[:2] in ("16", "4 ")]
    assert len(lines) == 8  # 2 w_bits x 2 batches x 2 prompt lengths, one table
    target = tmp_path / "o.csv"
    run_cli(["llama-2-7b", "--batch", "1,2", "--csv", str(target)], capsys)
    rows = list(csv.DictReader(io.StringIO(target.read_text())))
    # 2 results x 2 stages x (16 block rows + 3 model rows + 1 total)
    assert len(rows) == 2 * 2 * 20
    assert {r["batch"] for r in rows} == {"1", "2"}


@pytest.mark.parametrize("argv,msg", [
    (["llama-2-7b", "--hardware", "a600"], "hardware='a600' is unknown: expected one of"),
    (["llama-2-7b", "--batch", "0"], "batch='0' is invalid"),
    (["llama-2-7b", "--w-bits", "3"], "w_bits='3' is invalid: expected one of 32, 16, bf16, 8, fp8, 4"),
    (["no-such-model"], "model='no-such-model' is neither a named config"),
])
def test_errors_are_one_line_value_errors(capsys, argv, msg):
    with pytest.raises(ValueError) as e:
        run_cli(argv, capsys)
    assert msg in str(e.value) and "\n" not in str(e.value)


_FRESH = """
import argparse, sys
from rooflm.roofline.cli import register
p = argparse.ArgumentParser(prog="rooflm"); register(p.add_subparsers(dest="command"))
a = p.parse_args(["analyze", "llama-2-7b", "--hardware", "a6000", "--batch", "1", "--input-len", "2048"])
rc = a.func(a)
heavy = [m for m in ("torch", "numpy", "matplotlib") if m in sys.modules]
print("HEAVY", heavy, file=sys.stderr)
"""


def test_cli_imports_nothing_heavy():
    # The table must come quickly on a small CPU machine: that depends on what a fresh interpreter imports (torch
    # alone takes seconds), which is checked here instead of a wall-clock limit that a busy machine could break.
    p = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "HEAVY []" in p.stderr
    assert "q_proj" in p.stdout
