"""logit_bias: SamplingParams validation and the sampler's sparse bias (OpenAI's semantics)."""
from __future__ import annotations

import pytest
import torch

from rooflm.layers.sampler import Sampler, SamplingMetadata
from rooflm.sampling_params import SamplingParams


def _sample(logits: torch.Tensor, params: list[SamplingParams]):
    n = len(params)
    empty = [[] for _ in range(n)]
    md = SamplingMetadata.from_params(params, empty, empty, [None] * n, "cpu")
    return Sampler()(logits, md)


def test_bias_moves_the_greedy_choice_and_keeps_model_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    best = logits.argmax(dim=-1).tolist()
    target = [(b + 7) % 50 for b in best]
    params = [SamplingParams(temperature=0, logit_bias={target[0]: 100.0}, logprobs=1),
              SamplingParams(temperature=0, logit_bias={best[1]: -100.0}, logprobs=1),
              SamplingParams(temperature=0, logprobs=1)]
    out = _sample(logits, params)
    got = out.sampled_token_ids.tolist()
    assert got[0] == target[0]
    second = logits[1].clone()
    second[best[1]] = float("-inf")
    assert got[1] == int(second.argmax())
    assert got[2] == best[2]  # rows without a bias are untouched
    raw = torch.log_softmax(logits, dim=-1)
    for row in range(3):  # the chosen token's logprob is the model's, not the biased one
        assert out.logprobs[row, 0].item() == pytest.approx(raw[row, got[row]].item(), abs=1e-6)


def test_bias_applies_to_random_rows():
    logits = torch.zeros(2, 20)
    params = [SamplingParams(temperature=1.0, seed=3, logit_bias={5: 100.0}),
              SamplingParams(temperature=1.0, seed=4, logit_bias={t: -100.0 for t in range(19)})]
    md = SamplingMetadata.from_params(params, [[], []], [[], []],
                                      [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)], "cpu")
    for _ in range(20):
        assert Sampler()(logits, md).sampled_token_ids.tolist() == [5, 19]


def test_out_of_vocabulary_ids_are_skipped_by_the_sampler():
    logits = torch.randn(1, 10)
    out = _sample(logits, [SamplingParams(temperature=0, logit_bias={999: 100.0})])
    assert out.sampled_token_ids.item() == int(logits.argmax())


@pytest.mark.parametrize("bias", [{-1: 1.0}, {3: 101.0}, {3: float("nan")}, {"3": 1.0}, [(3, 1.0)], {3: True}])
def test_sampling_params_rejects_bad_logit_bias(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_empty_logit_bias_is_none():
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={4: -2}).logit_bias == {4: -2}
