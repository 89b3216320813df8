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
