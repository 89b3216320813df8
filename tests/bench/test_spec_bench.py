"""`rooflm bench latency --speculative-config`: the same prompts through a speculating engine over the same model, in
the same process, with the speed-up, acceptance and mean accepted length (tiny dummy workload on the CPU)."""
from __future__ import annotations

import json

import pytest

from rooflm.cli import main


def test_bench_latency_with_self_speculation(tmp_path, capsys):
    out = tmp_path / "latency.json"
    spec = '{"method": "self", "num_draft_layers": 6, "num_speculative_tokens": 2, "auto_disable": false}'
    assert main(["bench", "latency", "--model", "smollm2-135m", "--load-format", "dummy", "--device", "cpu",
                 "--dtype", "float32", "--input-len", "16", "--output-len", "6", "--batch-size", "2",
                 "--num-iters", "1", "--speculative-config", spec, "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    s = d["speculative"]
    assert s["speculative_config"]["method"] == "self"
    assert s["identical_tokens"] is True
    assert s["draft_tokens"] > 0 and 0 <= s["acceptance_rate"] <= 1
    assert 1 <= s["mean_accepted_length"] <= 3
    assert s["speedup_decode"] == pytest.approx(d["tpot_s"] / s["tpot_s"], rel=1e-6)
    assert "greedy tokens identical: True" in capsys.readouterr().out
