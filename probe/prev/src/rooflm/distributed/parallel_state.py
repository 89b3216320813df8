"""Process-group state for tensor parallelism (Megatron-LM, Shoeybi et al. 2019), with vLLM's names.

One process per rank. ``init_distributed`` joins the group and records this rank. The layers read ``get_tp_size()``
/ ``get_tp_rank()`` (and the pipeline's) when they are built, to allocate only their shard, keep what they read, and
call the communication ops below in ``forward`` only when their own size is above 1. The getters report the group
only inside ``building_sharded_model()`` (the engine enters it while it builds and loads the model of a group):
any other model built in the same process, e.g. a second engine at one rank, is whole and never communicates.
Without an initialised group (the default: one process) the sizes are 1 and the ranks 0.

Two groups cover all the ranks:

- the *device group* (NCCL on CUDA, gloo on the CPU) carries activations: the pipeline's sends and receives and its
  logits broadcast;
- the *CPU group* (always gloo) carries pickled Python objects: ``broadcast_object`` (each step's scheduler
  output) and ``all_reduce_min`` (the KV pool size every rank can afford). Keeping control traffic off NCCL avoids a
  device synchronisation per message.

A third, the *tensor-parallel group* (device backend), holds the ranks of one pipeline stage and carries
``tp_all_reduce`` and ``tp_all_gather``. With ``world_size = tp * pp`` rank r runs stage ``r // tp`` as tensor-parallel
rank ``r % tp``: the ranks of a stage are neighbours (on one host, the fast links), and a stage sends its activations
to the rank of the same tensor-parallel rank in the next stage. Without pipeline parallelism it is the device group.

Expert parallelism (``expert_parallel``, vLLM's ``enable_expert_parallel``) spans the tensor-parallel group: a
mixture-of-experts layer gives each of its ranks whole experts instead of a slice of every expert
(``get_ep_size`` / ``get_ep_rank``); its partial outputs meet in the same ``tp_all_reduce``.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    """This rank's place among ``world_size = tp_size * pp_size`` ranks: pipeline stage ``rank // tp_size``,
    tensor-parallel rank ``rank % tp_size`` within it. ``tp_group``: the device group of this rank's stage (None: the
    device group, when one stage spans every rank). ``expert_parallel``: mixture-of-experts layers split their
    experts over the tensor-parallel ranks."""

    world_size: int
    rank: int
    device: torch.device
    backend: str
    device_group: Any
    cpu_group: Any
    pp_size: int = 1
    tp_group: Any = None
    expert_parallel: bool = False
    one_shot: Any = None  # OneShotAllReduce for small CUDA all-reduces (small_collectives.py), None: NCCL/gloo only

    def __post_init__(self) -> None:
        if self.tp_group is None:
            self.tp_group = self.device_group

    @property
    def tp_size(self) -> int:
        return self.world_size // self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def ep_size(self) -> int:
        return self.tp_size if self.expert_parallel else 1

    def global_rank(self, pp_rank: int) -> int:
        """The rank of pipeline stage ``pp_rank`` that has this rank's tensor-parallel rank."""
        return pp_rank * self.tp_size + self.tp_rank


_STATE: ParallelState | None = None
_BUILDING = False  # inside building_sharded_model()


@contextlib.contextmanager
def building_sharded_model() -> Iterator[None]:
    """Models built (and loaded) inside take their shard of the process group's ranks."""
    global _BUILDING
    before, _BUILDING = _BUILDING, True
    try:
        yield
    finally:
        _BUILDING = before


def init_distributed(world_size: int, rank: int, init_method: str, device: torch.device,
                     timeout_s: float = 600.0, pp_size: int = 1,
                     control_timeout_s: float | None = None, expert_parallel: bool = False) -> ParallelState:
    """Join the process group of ``world_size`` ranks as ``rank`` (``init_method``: a ``file://`` or ``tcp://`` URL,
    or ``env://`` under torchrun); ``pp_size``: the pipeline stages, a divisor of ``world_size`` (each stage then has
    ``world_size // pp_size`` tensor-parallel ranks); ``expert_parallel``: see the module docstring. NCCL
    when ``device`` is CUDA, gloo otherwise. ``timeout_s`` bounds every collective, so a rank that stops answering
    ends the others with an error instead of a hang; ``control_timeout_s`` replaces it on the CPU group
    (a worker that waits there for the next step may wait as long as the engine idles)."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError("the distributed state is already initialised in this process")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is invalid for world_size={world_size}")
    if pp_size < 1 or world_size % pp_size:
        raise ValueError(f"pp_size={pp_size} is invalid for world_size={world_size}: expected a divisor of it "
                         "(tensor_parallel_size x pipeline_parallel_size ranks)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank, timeout=timeout)
    device_group = dist.group.WORLD
    if backend != "gloo" or control_timeout_s is not None:
        control = timeout if control_timeout_s is None else datetime.timedelta(seconds=control_timeout_s)
        cpu_group = dist.new_group(backend="gloo", timeout=control)
    else:
        cpu_group = device_group
    tp = world_size // pp_size
    tp_group = None
    if 1 < pp_size < world_size:
        # every rank creates every stage's group, in the same order (new_group is collective over the world)
        for stage in range(pp_size):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
            if stage == rank // tp:
                tp_group = group
    _STATE = ParallelState(world_size, rank, device, backend, device_group, cpu_group, pp_size, tp_group,
                           bool(expert_parallel))
    if backend == "nccl" and _STATE.tp_size > 1:
        from rooflm.distributed.small_collectives import OneShotAllReduce, rendezvous_count

        token = [uuid.uuid4().hex if rank == 0 else ""]  # names this engine's symmetric memory (symmetric_name)
        dist.broadcast_object_list(token, src=0, group=cpu_group)
        if counts_agree(rendezvous_count()):  # else the buffer exchange would never meet (see rendezvous_count)
            # a collective over this stage's ranks, at the same point on every rank
            _STATE.one_shot = OneShotAllReduce.create(_STATE.tp_group, device, token=token[0])
        elif rank == 0:
            logging.getLogger(__name__).warning(
                "this process set up peer-memory all-reduces for an earlier engine and its new workers have not: "
                "PyTorch's symmetric-memory exchange would not meet (github.com/pytorch/pytorch/issues/196082), so "
                "every all-reduce of this engine goes through NCCL; start one tensor-parallel engine per process "
                "for the faster path")
        if all_reduce_min(int(_STATE.one_shot is not None)) == 0:  # one path for all ranks, or their collectives
            _STATE.one_shot = None                                 # would not meet
    return _STATE


# Called with clean=True / False just before this process leaves its process group (see ``before_leaving``).
_BEFORE_LEAVING: list[Callable[[bool], None]] = []


def before_leaving(fn: Callable[[bool], None]) -> None:
    """Run ``fn(clean)`` once, before this process leaves its process group: ``clean`` True on the orderly way out
    (``destroy_distributed``), False after a peer failed (``abandon_distributed``).

    For CUDA graphs that may hold collectives: NCCL counts, per communicator, the graphs that captured one of its
    operations, and its teardown (``ncclCommDestroy`` and ``ncclCommAbort`` alike) waits until those graphs are
    destroyed. A process that still holds them when it leaves the group never returns from the teardown, so the
    decode graphs are released here first."""
    _BEFORE_LEAVING.append(fn)


def _run_before_leaving(clean: bool) -> None:
    fns = list(_BEFORE_LEAVING)
    _BEFORE_LEAVING.clear()
    for fn in fns:
        try:
            fn(clean)
        except Exception as e:  # noqa: BLE001 - leaving the group must not fail on a release
            logging.getLogger(__name__).warning("release before leaving the process group failed: %s: %s",
                                                type(e).__name__, e)


def destroy_distributed() -> None:
    """Leave the process group (a no-op when none was joined), after the ``before_leaving`` callbacks.

    An NCCL group is left by an abort once the device has finished its work. NCCL's orderly teardown of a
    communicator that carried traffic waits for every rank's, but the ranks of an engine leave one after the other
    (each worker after its last step, rank 0 once they have exited), so it would wait for peers that have gone or
    have not come yet; with nothing in flight an abort, which is local, loses nothing. gloo's teardown is local."""
    global _STATE
    _run_before_leaving(True)
    state, _STATE = _STATE, None
    if state is None or not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if state.backend == "nccl" and abort is not None:
        torch.cuda.synchronize(state.device)
        abort()
    else:
        dist.destroy_process_group()


def get_state() -> ParallelState | None:
    return _STATE


def _sharding() -> bool:
    return _STATE is not None and _BUILDING


def get_tp_size() -> int:
    return _STATE.tp_size if _sharding() else 1


def get_tp_rank() -> int:
    return _STATE.tp_rank if _sharding() else 0


def get_ep_size() -> int:
    """Ranks a mixture-of-experts layer splits its experts over: the tensor-parallel size under expert
    parallelism, else 1 (each tensor-parallel rank then holds a slice of every expert)."""
    return _STATE.ep_size if _sharding() else 1


def get_ep_rank() -> int:
    return _STATE.tp_rank if _sharding() and _STATE.expert_parallel else 0


def get_pp_size() -> int:
    return _STATE.pp_size if _sharding() else 1


def get_pp_rank() -> int:
    return _STATE.pp_rank if _sharding() else 0


def pp_send(x: torch.Tensor, dst: int) -> None:
    """Send ``x`` to pipeline stage ``dst``, to the rank there with this rank's tensor-parallel rank (the receiver
    knows its shape and dtype)."""
    dist.send(x.contiguous(), _STATE.global_rank(dst), group=_STATE.device_group)


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
    """Receive a tensor of ``shape`` and ``dtype`` from pipeline stage ``src`` (the rank there with this rank's
    tensor-parallel rank), on this rank's device."""
    x = torch.empty(shape, dtype=dtype, device=_STATE.device)
    dist.recv(x, _STATE.global_rank(src), group=_STATE.device_group)
    return x


def pp_broadcast(x: torch.Tensor, src: int) -> torch.Tensor:
    """``x`` from pipeline stage ``src`` (its tensor-parallel rank 0) on every rank (in place: the others pass a
    buffer of the right shape)."""
    dist.broadcast(x, src * _STATE.tp_size, group=_STATE.device_group)
    return x


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel ranks (use the result: in place for NCCL and gloo, a new tensor
    on the one-shot path; ``x`` itself at size 1). Every rank ends with the same values: the ring algorithms of gloo
    and NCCL reduce each chunk once and then copy it around; the one-shot path sums in rank order on every rank."""
    if _STATE is None or _STATE.tp_size == 1:
        return x
    if _STATE.one_shot is not None and _STATE.one_shot.eligible(x):
        return _STATE.one_shot(x)  # a new tensor: small decode all-reduces, one kernel (small_collectives.py)
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tp_all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rms_norm(s) * weight, s) with s = ``tp_all_reduce(x) + residual``, in one kernel where the one-shot path
    takes ``x`` (16-bit decode rows, ``OneShotAllReduce.all_reduce_rms_norm``); None otherwise: the caller reduces,
    then normalises."""
    if _STATE is None or _STATE.tp_size == 1 or _STATE.one_shot is None:
        return None
    fused = getattr(_STATE.one_shot, "all_reduce_rms_norm", None)
    return fused(x, residual, weight, eps) if fused is not None else None


def tp_all_gather(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dimension; ``sizes`` lists every rank's width there (they may
    differ by one when a dimension does not split evenly: the narrow shards are padded for the collective and the
    padding dropped). ``x`` itself at size 1."""
    if _STATE is None or _STATE.tp_size == 1:
        return x
    one_shot = _STATE.one_shot
    gathered_bytes = x.numel() // x.shape[-1] * sum(sizes) * x.element_size()
    if one_shot is not None and x.is_cuda and gathered_bytes <= one_shot.max_bytes:
        from rooflm.distributed.small_collectives import gather_by_sum

        return gather_by_sum(x.contiguous(), sizes, _STATE.tp_rank, one_shot)
    width = max(sizes)
    if x.shape[-1] < width:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x, group=_STATE.tp_group)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """``obj`` from rank ``src`` to every rank (pickled, over the CPU group); returns it on every rank."""
    if _STATE is None or _STATE.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_STATE.cpu_group)
    return box[0]


def all_reduce_min(value: int) -> int:
    """The smallest ``value`` over the ranks (over the CPU group)."""
    if _STATE is None or _STATE.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.cpu_group)
    return int(t.item())


def counts_agree(count: int) -> bool:
    """Whether every rank passed the same ``count`` (two reductions over the CPU group; True at one rank)."""
    return all_reduce_min(count) == -all_reduce_min(-count)


def abandon_distributed() -> None:
    """Leave the process group after a peer died: gloo's teardown is local; an NCCL group is aborted without waiting
    for the device (a collective of the last step may never finish)."""
    global _STATE
    _run_before_leaving(False)
    state, _STATE = _STATE, None
    if state is None or not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if state.backend == "nccl" and abort is not None:
        abort()
    else:
        dist.destroy_process_group()
