"""The sampler's checks again on CUDA (generators on the logits' device). Skipped without CUDA."""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from rooflm.layers.sampler import SamplingMetadata, make_generator
from rooflm.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")



def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_cpu_{name}", Path(__file__).parent.parent / "unit" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The CPU test modules' helpers (reference probabilities, chi-square check, seeded runs, the matrix of row mixes).
_cpu, _no_sync = _load("test_sampler"), _load("test_sampler_no_sync")
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


@contextmanager
def cuda_sync_is_an_error() -> Iterator[None]:
    """Any synchronising CUDA call (a device-to-host copy, a blocking host-to-device copy, a stream sync) raises."""
    torch.cuda.synchronize()  # inputs ready: nothing left that a later sync would be waiting for
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sync_debug_mode_catches_a_sync():
    t = torch.randn(8, device="cuda")
    with pytest.raises(RuntimeError):
        with cuda_sync_is_an_error():
            bool((t > 0).any())
    with pytest.raises(RuntimeError):
        with cuda_sync_is_an_error():
            torch.tensor([1, 2, 3]).to("cuda")  # a blocking copy from pageable memory
    bool((t > 0).any())


@pytest.mark.parametrize("name", _no_sync.MATRIX)
def test_sampler_makes_no_cuda_sync(name):
    torch.manual_seed(0)
    _no_sync.check_case(name, "cuda", cuda_sync_is_an_error)


def test_argmax_tokens_is_argmax_on_cuda():
    """Greedy choices go through ``max``: on CUDA too it returns the first of equal maxima, as ``argmax`` does."""
    from rooflm.layers.sampler import argmax_tokens

    gen = torch.Generator(device="cuda").manual_seed(0)
    for trial in range(100):
        x = torch.randint(0, 4, (8, 49152), device="cuda", generator=gen).float()
        if trial % 3 == 0:
            x[1, :7] = float("nan")
        if trial % 5 == 0:
            x = x[:, ::3]
        assert torch.equal(argmax_tokens(x), x.argmax(dim=-1))
        assert torch.equal(argmax_tokens(x.half()), x.half().argmax(dim=-1))
