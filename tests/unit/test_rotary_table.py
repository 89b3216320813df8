"""The CPU path's rotary cos / sin come from a table made once with numpy in float64 (a lookup, no arithmetic per
step): the values are the correctly rounded cos / sin of the float32 angles the GPU path forms, the same at every
call, and the table follows ``inv_freq`` when it is re-made."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rooflm.layers.rotary import RotaryEmbedding, compute_inv_freq
from rooflm.layers.sampler import argmax_tokens


def _reference(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    angles = (positions.float()[:, None] * inv_freq.float()[None, :]).double().numpy()
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def test_cos_sin_are_the_rounded_float64_values_of_the_float32_angles():
    rot = RotaryEmbedding(64, 100000.0)
    positions = torch.tensor([0, 1, 2, 77, 1023, 4095, 4096, 9000, 5])  # past the first table size: it grows
    cos, sin = rot.cos_sin(positions, torch.float32)
    ref_cos, ref_sin = _reference(positions, rot.inv_freq)
    assert cos.shape == sin.shape == (9, 32) and cos.dtype == torch.float32
    assert np.array_equal(cos.numpy(), ref_cos) and np.array_equal(sin.numpy(), ref_sin)
    assert rot.host_table(1).shape[0] >= 9001
    # within float32 rounding of torch's own float32 maths (what the GPU path computes)
    freqs = positions.float()[:, None] * rot.inv_freq[None, :]
    assert torch.allclose(cos, freqs.cos(), rtol=0, atol=1e-6) and torch.allclose(sin, freqs.sin(), rtol=0, atol=1e-6)


def test_cos_sin_repeat_exactly_and_cast_to_the_asked_dtype():
    rot = RotaryEmbedding(16, 10000.0)
    positions = torch.arange(300).flip(0)
    first = rot.cos_sin(positions, torch.float32)
    for _ in range(20):
        again = rot.cos_sin(positions.clone(), torch.float32)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    half = rot.cos_sin(positions, torch.bfloat16)
    assert half[0].dtype == torch.bfloat16 and torch.equal(half[0], first[0].to(torch.bfloat16))


def test_table_is_remade_with_inv_freq():
    rot = RotaryEmbedding(32, 10000.0)
    positions = torch.arange(10)
    before, _ = rot.cos_sin(positions, torch.float32)
    with torch.no_grad():
        rot.inv_freq.mul_(0.5)  # weights built on the meta device get their values from init_buffers
    rot.init_buffers()
    assert torch.equal(rot.inv_freq, compute_inv_freq(32, 10000.0, None))
    after, _ = rot.cos_sin(positions, torch.float32)
    assert torch.equal(before, after)
    rot.inv_freq.mul_(0.5)
    rot.__dict__.pop("_host_table")
    halved, _ = rot.cos_sin(positions, torch.float32)
    assert np.array_equal(halved.numpy(), _reference(positions, rot.inv_freq)[0])
    assert not torch.equal(halved, before)


def test_argmax_tokens_is_argmax_with_ties_nan_and_strides():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        x = torch.randint(0, 4, (3, 5000), generator=gen).float()  # many equal maxima: the first one wins
        if trial % 3 == 0:
            x[1, torch.randint(0, 5000, (2,), generator=gen)] = float("nan")
        if trial % 4 == 0:
            x[2] = float("-inf")
        if trial % 5 == 0:
            x = x[:, ::3]
        assert torch.equal(argmax_tokens(x), x.argmax(dim=-1))
    assert argmax_tokens(torch.tensor([[1.0, 3.0, 3.0, 2.0]])).tolist() == [1]


def test_the_gpu_lookup_table_is_asked_for_by_bound_and_is_a_no_op_off_cuda():
    rot = RotaryEmbedding(16, 10000.0)
    with pytest.raises(ValueError, match="num_positions=0"):
        rot.use_device_table(0, torch.float16)
    rot.use_device_table(4096, torch.float32)  # the CPU keeps its float64-rounded host table
    positions = torch.arange(50)
    cos, _ = rot.cos_sin(positions, torch.float32)
    assert np.array_equal(cos.numpy(), _reference(positions, rot.inv_freq)[0])
