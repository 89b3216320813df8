"""The one-shot all-reduce's routing and the zero-padded gather (the GPU kernel itself: tests/gpu/test_gpu_tp.py and
tests/gpu/allreduce_bench.py)."""
from __future__ import annotations

import pytest
import torch

from rooflm.config import EngineConfig
from rooflm.distributed import parallel_state as ps
from rooflm.distributed.executor import tp_cuda_graphs
from rooflm.distributed.small_collectives import OneShotAllReduce, gather_by_sum, requested_mode


@pytest.mark.parametrize("sizes", [[5, 5], [6, 5], [3, 3, 2, 2]])
def test_gather_by_sum_equals_concatenation(sizes):
    g = torch.Generator().manual_seed(len(sizes))
    shards = [torch.randn(4, w, generator=g) for w in sizes]
    shards[0][0, 0] = float("-inf")  # masked logits survive: -inf + 0 = -inf
    fulls: list[torch.Tensor] = []

    def record(full: torch.Tensor) -> torch.Tensor:  # every rank's padded tensor, summed below as the group would
        fulls.append(full)
        return full

    for rank, x in enumerate(shards):
        gather_by_sum(x, sizes, rank, record)
    summed = fulls[0].clone()
    for f in fulls[1:]:
        summed += f
    assert torch.equal(summed, torch.cat(shards, dim=-1))


def test_one_shot_is_off_on_the_cpu_and_when_asked(monkeypatch):
    assert OneShotAllReduce.create(None, torch.device("cpu")) is None
    monkeypatch.setenv("ROOFLM_TP_ALLREDUCE", "nccl")
    assert OneShotAllReduce.create(None, torch.device("cuda", 0)) is None
    monkeypatch.setenv("ROOFLM_TP_ALLREDUCE", "fast")
    with pytest.raises(ValueError, match="ROOFLM_TP_ALLREDUCE='fast'"):
        requested_mode()


class _Recorder:
    """Stands in for the one-shot communicator: takes tensors up to ``max_bytes``, returns them doubled."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.seen: list[tuple[int, ...]] = []

    def eligible(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(x.shape))
        return x * 2


@pytest.fixture
def fake_group(monkeypatch):
    state = ps.ParallelState(2, 0, torch.device("cpu"), "gloo", None, None, one_shot=_Recorder(64))
    monkeypatch.setattr(ps, "_STATE", state)
    return state


def test_small_all_reduces_take_the_one_shot_path_and_large_ones_do_not(fake_group, monkeypatch):
    calls = []
    monkeypatch.setattr(ps.dist, "all_reduce", lambda x, group=None: calls.append(tuple(x.shape)))
    small, large = torch.ones(4, 4), torch.ones(8, 8)  # 64 bytes, 256 bytes of float32
    assert torch.equal(ps.tp_all_reduce(small), small * 2)
    assert ps.tp_all_reduce(large) is large
    assert fake_group.one_shot.seen == [(4, 4)] and calls == [(8, 8)]


def test_tp_cuda_graphs_follow_the_one_shot_path(fake_group, monkeypatch):
    config = EngineConfig(model="smollm2-135m")
    assert tp_cuda_graphs(config)  # auto: the one-shot path is up
    fake_group.one_shot = None
    assert not tp_cuda_graphs(config)
    monkeypatch.setenv("ROOFLM_TP_CUDA_GRAPHS", "1")
    assert tp_cuda_graphs(config)
    monkeypatch.setenv("ROOFLM_TP_CUDA_GRAPHS", "0")
    fake_group.one_shot = _Recorder(64)
    assert not tp_cuda_graphs(config)
    monkeypatch.setenv("ROOFLM_TP_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="ROOFLM_TP_CUDA_GRAPHS='yes'"):
        tp_cuda_graphs(config)


def test_each_process_group_meets_its_peers_under_a_new_symmetric_memory_name(tmp_path):
    """A process group made after destroy_process_group gets the earlier group's name again; PyTorch's symmetric
    memory would then exchange buffers through the destroyed group's store (a second tensor-parallel engine in one
    process hung there). Each group registers its own store under a name carrying a per-engine token."""
    import torch.distributed as dist

    from rooflm.distributed.small_collectives import symmetric_name

    names, group_names = [], []
    for i, token in enumerate(("a1b2", "c3d4")):  # two engines, one after the other, in this process
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / str(i)}", world_size=1, rank=0)
        try:
            group = dist.new_group([0])
            group_names.append(group.group_name)
            names.append(symmetric_name(group, token))
        finally:
            dist.destroy_process_group()
    assert group_names[0] == group_names[1]  # what PyTorch does: the same name for the second group
    assert names == [f"rooflm-a1b2-{group_names[0]}", f"rooflm-c3d4-{group_names[0]}"]


class _FusingRecorder(_Recorder):
    """Also stands in for the fused all-reduce + add + RMSNorm: answers for rows of 4 elements only."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.fused: list[tuple[int, ...]] = []

    def all_reduce_rms_norm(self, x, residual, weight, eps):
        if x.shape[-1] != 4:
            return None
        self.fused.append(tuple(x.shape))
        return x * 0 - 1, residual


def test_the_reducing_norm_fuses_where_the_communicator_can_and_reduces_then_normalises_elsewhere(monkeypatch):
    from rooflm.layers.custom_op import op_selection
    from rooflm.layers.norm import AllReduceRMSNorm, RMSNorm, add_rms_norm

    state = ps.ParallelState(2, 0, torch.device("cpu"), "gloo", None, None, one_shot=_FusingRecorder())
    monkeypatch.setattr(ps, "_STATE", state)
    with op_selection("cpu", ops="native"):
        norms = {h: RMSNorm(h, 1e-6) for h in (4, 6)}
    for norm in norms.values():
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    with op_selection("cpu", ops="triton"):
        ops = {h: AllReduceRMSNorm(norm) for h, norm in norms.items()}
    x4, r4 = torch.randn(3, 4), torch.randn(3, 4)
    out, res = ops[4](x4, r4)
    assert torch.equal(out, -torch.ones(3, 4)) and res is r4 and state.one_shot.fused == [(3, 4)]
    x6, r6 = torch.randn(3, 6), torch.randn(3, 6)
    out, res = ops[6](x6, r6)  # declined: the one-shot all-reduce (the recorder doubles), then the norm
    want, want_res = add_rms_norm(x6 * 2, r6, norms[6].weight, 1e-6)
    assert torch.equal(out, want) and torch.equal(res, want_res) and state.one_shot.seen == [(3, 6)]
    with op_selection("cpu", ops="native"):
        native = AllReduceRMSNorm(norms[4])
    out, _ = native(x4, r4)  # the reference path never fuses
    assert torch.equal(out, add_rms_norm(x4 * 2, r4, norms[4].weight, 1e-6)[0]) and state.one_shot.fused == [(3, 4)]


def test_counts_agree_only_when_every_rank_has_the_same(monkeypatch):
    """A second engine's rank 0 has made one symmetric-memory rendezvous more than its fresh workers: the counts
    differ and the engine takes NCCL (PyTorch's exchange keys would not meet); equal counts keep the fast path."""
    others: list[int] = []
    calls = []

    def all_reduce_min(v):  # the other ranks pass their count, then its negation, as this rank does
        sign = -1 if len(calls) % 2 else 1
        calls.append(v)
        return min([v] + [sign * o for o in others])

    monkeypatch.setattr(ps, "all_reduce_min", all_reduce_min)
    others[:] = [0]
    assert ps.counts_agree(0) and not ps.counts_agree(1)
    others[:] = [2, 2]
    assert ps.counts_agree(2) and not ps.counts_agree(0) and not ps.counts_agree(3)
    monkeypatch.undo()
    assert ps.counts_agree(5)  # no process group: one rank agrees with itself


def test_rendezvous_is_counted_only_when_started(monkeypatch):
    """The CPU and ROOFLM_TP_ALLREDUCE=nccl return before any exchange: the count does not move."""
    from rooflm.distributed import small_collectives as sc

    before = sc.rendezvous_count()
    assert OneShotAllReduce.create(None, torch.device("cpu")) is None
    monkeypatch.setenv("ROOFLM_TP_ALLREDUCE", "nccl")
    assert OneShotAllReduce.create(None, torch.device("cuda", 0)) is None
    assert sc.rendezvous_count() == before
