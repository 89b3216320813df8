"""A step's inputs into a CUDA graph's static buffers in one launch (rooflm/kernels/graph_inputs.py) against its
twin, the torch copies and fills: every buffer equal afterwards, for decode rows (q = 1) and verify rows (q > 1),
with and without padding rows, a table narrower than the buffer's; inputs that do not fit are named."""
from __future__ import annotations

import pytest
import torch


def _buffers(device, max_t=40, max_n=12, max_w=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-5, 5, (max_t,), generator=g).to(device),
            torch.randint(-5, 5, (max_t,), generator=g).to(device),
            torch.randint(-5, 5, (max_t,), generator=g).to(device),
            torch.randint(-5, 5, (max_n,), generator=g, dtype=torch.int32).to(device),
            torch.randint(-5, 5, (max_n, max_w), generator=g, dtype=torch.int32).to(device))


def _step(device, n, q, w, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = n * q
    return (torch.randint(0, 32000, (t,), generator=g).to(device), torch.randint(0, 4096, (t,), generator=g).to(device),
            torch.randint(-1, 900, (t,), generator=g).to(device),
            torch.randint(0, 4096, (n,), generator=g, dtype=torch.int32).to(device),
            torch.randint(0, 500, (n, w), generator=g, dtype=torch.int32).to(device))


@pytest.mark.parametrize("n,q,bs,w", [(1, 1, 1, 1), (3, 1, 4, 5), (5, 1, 8, 9), (2, 3, 4, 4), (4, 2, 4, 7)])
def test_one_launch_writes_what_the_copies_and_fills_write(device, n, q, bs, w):
    from rooflm.kernels.graph_inputs import misfit, stage_inputs, stage_inputs_ref

    src = _step(device, n, q, w)
    got, want = _buffers(device), _buffers(device)
    assert misfit(src, got, n, q, bs) is None
    pad = 0 if q == 1 else q
    stage_inputs(src, got, n, q, bs, pad)
    stage_inputs_ref(src, want, n, q, bs, pad)
    for name, a, b in zip(("ids", "positions", "slots", "seq_lens", "table"), got, want):
        assert torch.equal(a, b), name
    assert (got[2][n * q: bs * q] == -1).all() and (got[3][n:bs] == pad).all()


def test_inputs_that_do_not_fit_are_named(device):
    from rooflm.kernels.graph_inputs import misfit, stage_inputs

    src, dst = _step(device, 2, 1, 3), _buffers(device)
    assert "seq_lens: a torch.int64" in misfit(src[:3] + (src[3].long(), src[4]), dst, 2, 1, 2)
    assert "block_tables: (2, 12)" in misfit(src[:4] + (torch.zeros(2, 12, dtype=torch.int32, device=device),),
                                              dst, 2, 1, 2)
    assert "smaller than the bucket" in misfit(src, dst, 2, 1, 16)
    assert "input_ids: expected 2 contiguous" in misfit((src[0][:1],) + src[1:], dst, 2, 1, 2)
    with pytest.raises(ValueError, match="stage_inputs: slot_mapping: a torch.int32"):
        stage_inputs(src[:2] + (src[2].int(),) + src[3:], dst, 2, 1, 2, 0)
