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
