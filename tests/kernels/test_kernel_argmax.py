"""The row-wise argmax kernel (rooflm/kernels/argmax.py) against torch's ``max(dim=-1).indices``, index for index:
ties (the first of equal maxima, within a tile and across tiles), NaN (the first NaN wins), rows of -inf, widths that
are and are not a multiple of the tile, several rows, float16 and bfloat16 rows, a strided row view. On the CPU
under Triton's interpreter, on CUDA compiled."""
from __future__ import annotations

import pytest
import torch


def _check(x: torch.Tensor) -> None:
    from rooflm.kernels.argmax import argmax_rows, argmax_rows_ref

    got, want = argmax_rows(x), argmax_rows_ref(x)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got.cpu(), want.cpu()), f"{tuple(x.shape)} {x.dtype}: {got.tolist()} != {want.tolist()}"


@pytest.mark.parametrize("v", [1, 7, 1000, 16384, 32000, 40000])
def test_random_rows_match_torch(device, v):
    g = torch.Generator().manual_seed(v)
    _check(torch.randn(3, v, generator=g).to(device))


def test_ties_keep_the_first_index_within_and_across_tiles(device):
    v = 40000  # three tiles of 16,384
    x = torch.zeros(4, v)
    x[0, [5, 9, 30000]] = 2.0  # the first of three equal maxima, two in the first tile
    x[1, [20000, 39999]] = 3.0  # equal maxima in two later tiles: the earlier one
    x[2, [39999]] = 1.0  # the maximum in the last, partial tile
    x[3] = -1.0  # every value equal: index 0
    _check(x.to(device))


def test_nan_counts_as_the_largest_and_the_first_nan_wins(device):
    x = torch.randn(3, 40000, generator=torch.Generator().manual_seed(1))
    x[0, [30000, 35000]] = float("nan")
    x[0, 7] = float("inf")
    x[1, [100, 20000]] = float("nan")
    x[2, 39000] = float("inf")  # no NaN: +inf is the largest
    _check(x.to(device))


def test_rows_of_minus_infinity_give_zero_and_one_finite_value_wins(device):
    x = torch.full((2, 33000), float("-inf"))
    x[1, 32999] = -1e30
    _check(x.to(device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rows(device, dtype):
    x = (torch.randn(2, 5000, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    x[1, [10, 4000]] = x[1].max() + 1  # a tie in the rounded values
    _check(x.to(device))


def test_a_strided_view_of_rows(device):
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(3)).to(device)
    _check(x[::2, :2500])


def test_bad_input_names_the_shape(device):
    from rooflm.kernels.argmax import argmax_rows

    with pytest.raises(ValueError, match=r"\[N, V\].*shape \(5,\)"):
        argmax_rows(torch.randn(5, device=device))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        argmax_rows(torch.randn(8, 4, device=device).t())
    assert argmax_rows(torch.randn(0, 4, device=device)).shape == (0,)
