"""The llama.cpp baseline's plumbing: argument checks, and the retry without repacking buffers after a crash.
(llama.cpp itself is not installed on CI; docs/benchmarks.md has the measured comparison.)"""
import argparse
import json
import subprocess

import pytest

from rooflm.bench import latency, llamacpp


def _args(**kw):
    p = argparse.ArgumentParser()
    latency.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_llamacpp_baseline_needs_batch_one_and_a_gguf(monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    with pytest.raises(ValueError, match="--batch-size 1 \\(got 4\\)"):
        latency._check_llamacpp_args(_args(model="m.gguf", baseline="llama.cpp"), 4)
    with pytest.raises(ValueError, match="needs a .gguf --model, got 'llama-2-7b'"):
        latency._check_llamacpp_args(_args(model="llama-2-7b", baseline="llama.cpp"), 1)
    latency._check_llamacpp_args(_args(model="m.gguf", baseline="llama.cpp"), 1)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    with pytest.raises(ValueError, match="pip install llama-cpp-python"):
        latency._check_llamacpp_args(_args(model="m.gguf", baseline="llama.cpp"), 1)


def test_a_crash_is_retried_without_repacking_and_an_error_is_not(monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    calls = []
    result = {"ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 0.7, "decode_tok_s": 100.0, "e2e_tok_s": 90.0,
              "tokens": [1, 2], "version": "x", "threads": 2, "repack_buffers": False, "runs": 1}

    def crash_then_ok(cmd, **kw):
        calls.append(cmd)
        if "--no-repack" not in cmd:
            return subprocess.CompletedProcess(cmd, -11, "", "")
        with open(cmd[cmd.index("--prompts") + 1]) as f:
            assert json.load(f) == [[5, 6, 7]]
        return subprocess.CompletedProcess(cmd, 0, json.dumps(result) + "\n", "")

    monkeypatch.setattr(subprocess, "run", crash_then_ok)
    assert llamacpp.run_baseline("m.gguf", [[5, 6, 7]], 2, 2) == result
    assert len(calls) == 2 and "--no-repack" in calls[1]

    calls.clear()
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 1, "", "bad file"))
    with pytest.raises(RuntimeError, match="exit 1.*bad file"):
        llamacpp.run_baseline("m.gguf", [[1]], 2, 2)
    assert len(calls) == 1
