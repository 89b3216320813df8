"""SamplingParams validation: every bad value raises one ValueError naming the field and the value."""
from __future__ import annotations

import math

import pytest

from rooflm.sampling_params import SamplingParams

INVALID = [
    ("n", 0),
    ("n", -3),
    ("n", 1.5),
    ("n", True),
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("seed", 1.5),
    ("seed", "42"),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("stop", 5),
    ("stop", [1, 2]),
    ("stop", ["ok", ""]),
    ("stop", ""),
    ("stop", {"a": 1}),
    ("stop_token_ids", 7),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("logprobs", 21),
    ("logprobs", -1),
    ("prompt_logprobs", 100),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", None),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert f"SamplingParams.{field}=" in msg
    assert repr(value) in msg or repr([value]) in msg  # a lone stop string is shown as the list it became
    assert "expected" in msg


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens=5 .*max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-7).greedy


def test_valid_edge_values():
    SamplingParams(temperature=0, top_p=1, top_k=1, min_p=1, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(max_tokens=None, logprobs=0, prompt_logprobs=20, seed=-7, n=8)


def test_clone_validates():
    p = SamplingParams(temperature=0.5, stop="x")
    assert p.clone(seed=3).seed == 3 and p.clone().stop == ["x"]
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=0)
