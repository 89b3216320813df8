"""``rooflm bench spec --speculative-config`` takes one JSON object or a list of them (each measured against one
plain run); anything else is refused with the flag named."""
from __future__ import annotations

import json

import pytest

from rooflm.bench.speculative import spec_configs


def test_one_config_or_a_list_of_them():
    one = {"method": "ngram", "num_speculative_tokens": 4}
    two = {"method": "medusa", "model": "heads", "tree": [[0], [0, 0]]}
    assert [json.loads(c) for c in spec_configs(json.dumps(one))] == [one]
    assert [json.loads(c) for c in spec_configs(json.dumps([one, two]))] == [one, two]


@pytest.mark.parametrize("text", ["[]", "[1]", "3", "{bad"])
def test_other_values_are_refused(text):
    with pytest.raises(ValueError, match="--speculative-config="):
        spec_configs(text)


def test_interleaved_modes_measure_the_same_tokens(tmp_path, monkeypatch):
    """``--interleave`` loads plain decoding and each configuration at once and lets them take turns prompt batch by
    prompt batch: every mode still generates every prompt (the greedy tokens of all modes equal), each engine
    counts only its own steps, and the JSON says the run was interleaved."""
    from rooflm.bench import speculative
    from rooflm.cli import build_parser

    order = []
    run = speculative._Mode.run
    monkeypatch.setattr(speculative._Mode, "run", lambda self, batch: order.append(self.spec) or run(self, batch))
    out = tmp_path / "spec.json"
    # auto_disable off: whether a step drafts must not depend on the ceilings the live roofline measures at start-up
    configs = [{"method": "ngram", "num_speculative_tokens": k, "auto_disable": False} for k in (2, 3)]
    args = build_parser().parse_args(["bench", "spec", "--task", "repeat", "--num-prompts", "2", "--output-len", "12",
                                      "--speculative-config", json.dumps(configs), "--interleave", "--json",
                                      str(out)])
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    assert res["interleave"] is True and len(res["runs"]) == 2
    assert all(r["identical_tokens"] for r in res["runs"])
    assert res["plain"]["steps"] == 2 * 12  # its own steps only: two prompts, one token a step
    assert all(r["speculative"]["steps"] < 2 * 12 for r in res["runs"])  # the repeat task accepts drafts
    # the modes took turns: plain, then each configuration, for the first batch before any saw the second
    assert order == [None, json.dumps(configs[0]), json.dumps(configs[1])] * 2
