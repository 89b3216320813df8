"""StructuredOutputsParams validation (no grammar engine needed) and the bitmask application of the sampler."""
from __future__ import annotations

import pytest
import torch

from rooflm.sampling_params import SamplingParams
from rooflm.structured.manager import apply_token_bitmask
from rooflm.structured.params import StructuredOutputsParams


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")


@pytest.mark.parametrize("kw, field", [
    ({"json": "{not json"}, "json"),
    ({"json": [1, 2]}, "json"),
    ({"regex": ""}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 3]}, "choice"),
    ({"grammar": "  "}, "grammar"),
    ({"json_object": "yes"}, "json_object"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"StructuredOutputsParams\.{field}="):
        StructuredOutputsParams(**kw)


def test_json_text_is_parsed_and_keys_are_canonical():
    a = StructuredOutputsParams(json='{"b": 1, "a": {"type": "string"}}')
    b = StructuredOutputsParams(json={"a": {"type": "string"}, "b": 1})
    assert a.json == b.json and a.key() == b.key() and a.kind == "json"
    assert StructuredOutputsParams(regex="a+").key() != StructuredOutputsParams(grammar="a+").key()


def test_sampling_params_accepts_a_dict_and_refuses_unknown_keys_and_ignore_eos():
    p = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.choice == ["x", "y"]
    assert p.clone(n=2).structured_outputs is p.structured_outputs
    with pytest.raises(ValueError, match=r"structured_outputs has unknown field\(s\) \['schema'\]"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs="):
        SamplingParams(structured_outputs="regex")
    with pytest.raises(ValueError, match="SamplingParams.ignore_eos=True"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})


def test_bitmask_masks_exactly_the_cleared_bits():
    gen = torch.Generator().manual_seed(0)
    v = 70  # three 32-bit words, the last one partly used
    logits = torch.randn(3, v, generator=gen)
    allowed = torch.rand(3, v, generator=gen) < 0.3
    allowed[2] = True  # an unconstrained row
    words = torch.zeros(3, 3, dtype=torch.int64)
    for r in range(3):
        for t in range(v):
            if allowed[r, t]:
                words[r, t // 32] |= 1 << (t % 32)
    words[2] = -1
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    out = apply_token_bitmask(logits, bitmask)
    assert torch.equal(out[allowed], logits[allowed])
    assert torch.isneginf(out[~allowed]).all()
    assert torch.equal(out[2], logits[2])
