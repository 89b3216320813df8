"""The sampler's checks again on CUDA (generators on the logits' device). Skipped without CUDA."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from rooflm.layers.sampler import SamplingMetadata, make_generator
from rooflm.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# The CPU test module's helpers (reference probabilities, chi-square check, seeded runs).
_spec = importlib.util.spec_from_file_location("_cpu_sampler_tests",
                                               Path(__file__).parent.parent / "unit" / "test_sampler.py")
_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cpu)
run_steps, sampler, LOGITS6 = _cpu.run_steps, _cpu.sampler, _cpu.LOGITS6
ref_probs, assert_frequencies_match = _cpu.ref_probs, _cpu.assert_frequencies_match


def test_runs_unchanged_on_cuda():
    dev = "cuda"

    def md_on(params, gens=None, outputs=None):
        n = len(params)
        return SamplingMetadata.from_params(params, outputs or [[]] * n, [[]] * n, gens or [None] * n, dev)

    torch.manual_seed(3)
    row_logits = [torch.randn(500) for _ in range(6)]
    alone = run_steps(row_logits, position=0, batch=1, others_seed=0, device=dev)
    assert run_steps(row_logits, position=3, batch=6, others_seed=2, device=dev) == alone
    logits = torch.randn(32, 1000, device=dev)
    greedy = sampler(logits, md_on([SamplingParams(temperature=0)] * 32)).sampled_token_ids
    assert torch.equal(greedy, logits.argmax(dim=-1))
    params = [SamplingParams(temperature=50.0, top_k=1, logprobs=3, seed=i) for i in range(32)]
    out = sampler(logits, md_on(params, [make_generator(i, 0, dev) for i in range(32)], [[1]] * 32))
    assert torch.equal(out.sampled_token_ids, greedy)
    assert out.logprobs.shape == (32, 4) and out.logprobs.device.type == "cuda"
    draws = 20_000
    torch.manual_seed(1234)
    case = dict(temperature=1.3, min_p=0.12, top_k=4, top_p=0.85)
    big = torch.tensor(LOGITS6, dtype=torch.float32, device=dev).repeat(draws, 1)
    tokens = sampler(big, md_on([SamplingParams(**case)] * draws)).sampled_token_ids.cpu().numpy()
    assert_frequencies_match(np.bincount(tokens, minlength=6), ref_probs(LOGITS6, **case))
