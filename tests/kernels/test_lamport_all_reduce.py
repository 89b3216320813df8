"""The Lamport all-reduce (``rooflm/kernels/lamport_all_reduce.py``) under the Triton interpreter, every rank played
in one process: each call pushes for every rank first, then reduces for every rank, as the ranks' programs would
interleave on GPUs. (Two real GPUs: tests/gpu/test_gpu_tp.py and tests/gpu/allreduce_bench.py.)"""
from __future__ import annotations

import pytest
import torch


class Group:
    """``world`` ranks' buffers and state tensors, as peer-mapped memory would give them."""

    def __init__(self, world: int, cap: int, device: str) -> None:
        from rooflm.kernels.lamport_all_reduce import SENTINEL, LamportBuffers

        self.world, self.cap, self.device = world, cap, device
        size = LamportBuffers.elements(world, cap)
        self.buffers = [torch.full((size,), SENTINEL, dtype=torch.int16, device=device) for _ in range(world)]
        ptrs = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device=device)
        self.ranks = [LamportBuffers(ptrs, torch.zeros(3, dtype=torch.int32, device=device), r, world, cap,
                                     self.buffers[r])
                      for r in range(world)]

    def all_reduce(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        from rooflm.kernels.lamport_all_reduce import lamport_all_reduce

        outs = [torch.empty_like(x) for x in xs]
        for x, out, bufs in zip(xs, outs, self.ranks):
            lamport_all_reduce(x, bufs, out=out, reduce=False)
        for x, out, bufs in zip(xs, outs, self.ranks):
            lamport_all_reduce(x, bufs, out=out, push=False)
        return outs

    def all_reduce_rms_norm(self, xs, residual, weight, eps):
        from rooflm.kernels.lamport_all_reduce import lamport_all_reduce_rms_norm

        for x, bufs in zip(xs, self.ranks):
            lamport_all_reduce_rms_norm(x, residual, weight, eps, bufs, reduce=False)
        return [lamport_all_reduce_rms_norm(x, residual, weight, eps, bufs, push=False)
                for x, bufs in zip(xs, self.ranks)]

    def check_only_generation_holds_data(self, gen: int, n: int) -> None:
        """After a call of n elements in generation gen: that generation's first n elements of every slot hold data,
        everything else of every buffer is the sentinel again."""
        from rooflm.kernels.lamport_all_reduce import SENTINEL

        for r, buf in enumerate(self.buffers):
            assert int(self.ranks[r].state[0]) == (gen + 1) % 3 and int(self.ranks[r].state[1]) == n
            assert int(self.ranks[r].state[2]) == 0
            view = buf.view(3, self.world, self.cap)
            for g in range(3):
                for q in range(self.world):
                    used = n if g == gen else 0
                    assert bool((view[g, q, used:] == SENTINEL).all()), (r, g, q)
                    assert not bool((view[g, q, :used] == SENTINEL).any()), (r, g, q)


def rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros(xs[0].shape, dtype=torch.float32, device=xs[0].device)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_rank_gets_the_rank_order_sum_call_after_call(world, dtype, device):
    g = torch.Generator().manual_seed(world)
    group = Group(world, 3000, device)
    # growing and shrinking sizes: each call must clear exactly what the previous one left
    for call, n in enumerate([1000, 2500, 7, 3000, 1024, 1, 2049]):
        xs = [torch.randn(n, generator=g).to(dtype).to(device) for _ in range(world)]
        outs = group.all_reduce(xs)
        want = rank_order_sum(xs)
        for out in outs:
            assert torch.equal(out, outs[0]), (call, n)  # every rank the same bits
        if dtype == torch.bfloat16 and device == "cpu":  # the interpreter rounds float32 to bfloat16 toward zero
            torch.testing.assert_close(outs[0], want, rtol=2**-7, atol=0)
        else:
            assert torch.equal(outs[0], want), (call, n)
        group.check_only_generation_holds_data(call % 3, n)


def test_negative_zero_is_pushed_as_positive_zero_so_no_slot_looks_empty(device):
    from rooflm.kernels.lamport_all_reduce import SENTINEL, lamport_all_reduce

    group = Group(2, 64, device)
    xs = [torch.tensor([-0.0, 1.0, -0.0, 2.0], dtype=torch.float16, device=device),
          torch.tensor([-0.0, -0.0, 3.0, -2.0], dtype=torch.float16, device=device)]
    outs = [torch.empty_like(x) for x in xs]
    for x, out, bufs in zip(xs, outs, group.ranks):
        lamport_all_reduce(x, bufs, out=out, reduce=False)
    for buf in group.buffers:  # checked before any rank waits on these slots (a sentinel there would never clear)
        slots = buf.view(3, 2, 64)[0, :, :4]
        assert not bool((slots == SENTINEL).any())
        assert slots.view(torch.float16).tolist() == [[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 3.0, -2.0]]
    for x, out, bufs in zip(xs, outs, group.ranks):
        lamport_all_reduce(x, bufs, out=out, push=False)
    for out in outs:
        assert out.tolist() == [0.0, 1.0, 3.0, 0.0]
    group.check_only_generation_holds_data(0, 4)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows, hidden", [(1, 320), (3, 96), (2, 2500), (5, 257)])
def test_fused_norm_equals_all_reduce_then_reference_norm(with_residual, rows, hidden, device):
    from rooflm.kernels.rmsnorm import rms_norm_ref

    g = torch.Generator().manual_seed(rows * hidden)
    group = Group(2, 6000, device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).half().to(device)
    for call in range(4):  # and the generations advance with the plain calls in between
        xs = [torch.randn(rows, hidden, generator=g).half().to(device) for _ in range(2)]
        residual = torch.randn(rows, hidden, generator=g).half().to(device) if with_residual else None
        got = group.all_reduce_rms_norm(xs, residual, weight, 1e-5)
        s = rank_order_sum(xs)
        if with_residual:
            want, want_res = rms_norm_ref(s, weight, 1e-5, residual)
        else:
            want, want_res = rms_norm_ref(s, weight, 1e-5), s
        for out, res in got:
            assert torch.equal(res, want_res)
            torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)  # the statistic's summation order
        assert torch.equal(got[0][0], got[1][0])  # every rank the same bits
        group.check_only_generation_holds_data((2 * call) % 3, rows * hidden)
        group.all_reduce([torch.ones(5, device=device).half(), torch.ones(5, device=device).half()])
        group.check_only_generation_holds_data((2 * call + 1) % 3, 5)


def test_inputs_that_do_not_fit_are_refused_by_name():
    from rooflm.kernels.lamport_all_reduce import lamport_all_reduce, lamport_all_reduce_rms_norm

    group = Group(2, 16, "cpu")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        lamport_all_reduce(torch.ones(8), group.ranks[0])
    with pytest.raises(ValueError, match="17 elements"):
        lamport_all_reduce(torch.ones(17).half(), group.ranks[0])
    with pytest.raises(ValueError, match="residual"):
        lamport_all_reduce_rms_norm(torch.ones(2, 4).half(), torch.ones(2, 5).half(), torch.ones(4).half(), 1e-6,
                                    group.ranks[0])
    with pytest.raises(ValueError, match=r"rows x ceil\(hidden / 1024\) <= 512"):
        lamport_all_reduce_rms_norm(torch.ones(513, 1).half(), None, torch.ones(1).half(), 1e-6, group.ranks[0])
    with pytest.raises(ValueError, match="norm_weight"):
        lamport_all_reduce_rms_norm(torch.ones(2, 4).half(), None, torch.ones(5).half(), 1e-6, group.ranks[0])
    from rooflm.kernels.lamport_all_reduce import LamportBuffers

    bufs = group.ranks[0]
    size = LamportBuffers.elements(2, 16)
    for mine in (group.buffers[0].float(), group.buffers[0][:size - 1],  # another dtype, too short,
                 torch.zeros(size + 8, dtype=torch.int16)[1:]):  # 2 bytes past a 16-byte boundary
        with pytest.raises(ValueError, match="mine must be this rank's buffer"):
            LamportBuffers(bufs.buf_ptrs, bufs.state, 0, 2, 16, mine)


class _Handle:
    """What PyTorch's symmetric-memory rendezvous returns, for buffers of this process."""

    def __init__(self, buffers: list[torch.Tensor], rank: int) -> None:
        self.rank, self.world_size = rank, len(buffers)
        self.buffer_ptrs = [b.data_ptr() for b in buffers]
        self.pads = [torch.zeros(64, dtype=torch.int32, device=buffers[0].device) for _ in buffers]
        self.signal_pad_ptrs = [p.data_ptr() for p in self.pads]
        self.signal_pad_size = 64 * 4


def test_the_communicator_routes_16_bit_rows_through_the_lamport_kernels(device):
    """``OneShotAllReduce`` in its default mode: 16-bit tensors go through the Lamport kernels (rank 1 played by
    calling the kernel halves directly, so rank 0's whole call finds rank 1's data already pushed); float32 and
    tensors too large for the fused norm are declined or take the barrier kernel."""
    from rooflm.distributed.small_collectives import LAMPORT_MAX_BYTES, OneShotAllReduce
    from rooflm.kernels.lamport_all_reduce import (SENTINEL, LamportBuffers, lamport_all_reduce,
                                                   lamport_all_reduce_rms_norm)
    from rooflm.kernels.rmsnorm import rms_norm_ref

    max_bytes = 4096
    size = max_bytes + 2 * LamportBuffers.elements(2, LAMPORT_MAX_BYTES // 2)
    buffers = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2)]
    for b in buffers:
        b[max_bytes:].view(torch.int16).fill_(SENTINEL)
    comms = [OneShotAllReduce(b, "g", max_bytes, "lamport", _Handle(buffers, r)) for r, b in enumerate(buffers)]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 64, generator=g).half().to(device) for _ in range(2)]
    residual = torch.randn(2, 64, generator=g).half().to(device)
    weight = torch.rand(64, generator=g).half().to(device)

    lamport_all_reduce_rms_norm(xs[1], residual, weight, 1e-6, comms[1].lamport, reduce=False)
    got0 = comms[0].all_reduce_rms_norm(xs[0], residual, weight, 1e-6)
    got1 = lamport_all_reduce_rms_norm(xs[1], residual, weight, 1e-6, comms[1].lamport, push=False)
    want, want_res = rms_norm_ref(rank_order_sum(xs), weight, 1e-6, residual)
    assert torch.equal(got0[1], want_res) and torch.equal(got0[0], got1[0])
    torch.testing.assert_close(got0[0], want, atol=2e-3, rtol=2e-3)

    lamport_all_reduce(xs[1], comms[1].lamport, reduce=False)
    summed = comms[0](xs[0])
    assert torch.equal(summed, lamport_all_reduce(xs[1], comms[1].lamport, push=False))
    assert torch.equal(summed, rank_order_sum(xs))
    assert all(int(c.lamport.state[0]) == 2 for c in comms)  # two generations used, in step on both ranks

    assert comms[0].all_reduce_rms_norm(xs[0].float(), residual.float(), weight.float(), 1e-6) is None
    many_rows = torch.zeros(5, 64, dtype=torch.float16, device=device)  # above FUSED_NORM_MAX_ROWS: two kernels
    assert comms[0].all_reduce_rms_norm(many_rows, many_rows, weight, 1e-6) is None
    assert comms[0].lamport.fits(xs[0]) and not comms[0].lamport.fits(xs[0].float())
