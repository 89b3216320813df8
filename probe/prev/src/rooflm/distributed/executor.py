"""Rank 0's side of a multi-process engine: start the worker processes, send them each step, stop them.

``LLMEngine`` with ``tensor_parallel_size > 1`` (vLLM's multiprocessing executor, in spirit): the calling process
is rank 0 and owns the scheduler; it spawns ranks 1..N-1 (``torch.multiprocessing``, spawn start method), which
load their shard of the model and build their own ``ModelRunner`` (``rooflm.distributed.worker``). Each step rank 0
pickles the ``SchedulerOutput`` once, writes it to every worker's pipe, and runs the same step itself; the ranks
meet in the step's collectives, each samples from the same gathered logits with the same generator state, so every
``InputBatch`` stays in step. Only rank 0's outputs are read.

Steps travel over pipes rather than a collective: a worker waits for the next step without a timeout (an idle
server does not time out its workers), and a pipe to a dead process fails at once. Before each step rank 0 checks
every worker's exit code, so a worker that died between steps makes the next step raise ``RuntimeError`` naming it;
one that dies inside a step breaks the step's collective (gloo reports the closed connection; NCCL after its
timeout). Either way the engine stops every other worker before it raises, and later steps raise the same error.
Workers also exit when rank 0's end of their pipe closes (rank 0 died), so no process outlives the engine.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import shutil
import tempfile
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from rooflm.distributed import parallel_state as ps
from rooflm.logger import get_logger

if TYPE_CHECKING:
    from rooflm.config import EngineConfig
    from rooflm.engine.sched_output import SchedulerOutput
    from rooflm.worker.model_runner import ModelRunner, StepHandle

logger = get_logger(__name__)

_LIVE: "weakref.WeakSet[MultiprocExecutor]" = weakref.WeakSet()


@dataclasses.dataclass
class GeneratorState:
    """A request's sampling generator as it crosses to a worker: its state, rebuilt there on the worker's device."""

    state: torch.Tensor


def portable_output(out: "SchedulerOutput") -> "SchedulerOutput":
    """``out`` with each new request's ``torch.Generator`` replaced by its state (a generator belongs to one device;
    every rank rebuilds it on its own with the same state, so every rank draws the same numbers)."""
    if not any(n.generator is not None for n in out.new_reqs):
        return out
    new = [n if n.generator is None else dataclasses.replace(n, generator=GeneratorState(n.generator.get_state()))
           for n in out.new_reqs]
    return dataclasses.replace(out, new_reqs=new)


def restore_output(out: "SchedulerOutput", device: torch.device) -> "SchedulerOutput":
    """Inverse of ``portable_output`` on a worker: generators rebuilt on ``device``."""
    if not any(isinstance(n.generator, GeneratorState) for n in out.new_reqs):
        return out
    new = []
    for n in out.new_reqs:
        if isinstance(n.generator, GeneratorState):
            g = torch.Generator(device=device)
            g.set_state(n.generator.state)
            n = dataclasses.replace(n, generator=g)
        new.append(n)
    return dataclasses.replace(out, new_reqs=new)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or the CUDA device ``rank`` places after rank 0's."""
    if device.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", (device.index or 0) + rank)


def threads_per_rank(world_size: int) -> int:
    """Compute threads of each rank on the CPU: the process's CPUs shared out, at least one."""
    from rooflm.entrypoints.args import available_cpus

    return max(1, available_cpus() // world_size)


def tp_cuda_graphs(config: "EngineConfig") -> bool:
    """Whether tensor-parallel ranks capture decode CUDA graphs. ``ROOFLM_TP_CUDA_GRAPHS``: ``auto`` (default) captures
    them when the group's small all-reduces run one-shot over peer memory (``small_collectives.py``: a decode step's
    graph then holds no NCCL call), ``1`` also with NCCL collectives recorded in the graphs, ``0`` never. Every rank
    reaches the same answer (the one-shot set-up is agreed over the group). Never under pipeline parallelism."""
    mode = os.environ.get("ROOFLM_TP_CUDA_GRAPHS", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"ROOFLM_TP_CUDA_GRAPHS={mode!r}: expected 'auto', '0' or '1'")
    if config.pipeline_parallel_size != 1 or mode == "0":
        return False
    state = ps.get_state()
    return mode == "1" or (state is not None and state.one_shot is not None)


class WorkerDiedError(RuntimeError):
    """A worker process (tensor- or pipeline-parallel rank) ended while the engine needed it, or rank 0 failed in a
    step: the ranks can no longer run steps together."""


class MultiprocExecutor:
    """Spawns ranks 1..N-1, joins the process group as rank 0, and forwards each step (see the module docstring)."""

    def __init__(self, config: "EngineConfig", device: torch.device, timeout_s: float = 600.0) -> None:
        import torch.multiprocessing as mp

        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.pp_size = config.pipeline_parallel_size
        self.expert_parallel = config.enable_expert_parallel
        if ps.get_state() is not None:
            raise RuntimeError("this process already belongs to a process group: shut the other engine down "
                               "(LLM.shutdown()) before starting another")
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + self.world_size:
            raise ValueError(f"{self.world_size} ranks (tensor_parallel_size x pipeline_parallel_size) need "
                             f"{self.world_size} CUDA devices from "
                             f"{device}, this machine has {torch.cuda.device_count()}")
        self.device = rank_device(device, 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread: the group is joined in another
        self.error: str | None = None
        self._closed = False
        self._store_dir = tempfile.mkdtemp(prefix="rooflm-tp-")
        init_method = "file://" + os.path.join(self._store_dir, "store")
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.pipes: list[Any] = []
        from rooflm.distributed.worker import run_worker

        for rank in range(1, self.world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=run_worker, name=f"rooflm-rank{rank}", daemon=True,
                            args=(rank, self.world_size, init_method, config, rank_device(device, rank), recv,
                                  timeout_s, self.pp_size))
            p.start()
            recv.close()  # the worker holds the reading end; its closing tells a worker rank 0 is gone
            self.procs.append(p)
            self.pipes.append(send)
        _LIVE.add(self)
        if self.device.type == "cpu":
            torch.set_num_threads(min(torch.get_num_threads(), threads_per_rank(self.world_size)))
        self._join_group(init_method, timeout_s)
        logger.info("%d ranks (%d tensor-parallel x %d pipeline stages%s, %s), workers %s", self.world_size,
                    self.world_size // self.pp_size, self.pp_size, ", expert-parallel" if self.expert_parallel else "",
                    ps.get_state().backend, [p.pid for p in self.procs])

    def _join_group(self, init_method: str, timeout_s: float) -> None:
        """Join the group in a helper thread while watching the workers: one that dies before it joins (a failed
        import, a bad device) ends the wait at once instead of after the group's timeout."""
        failure: list[BaseException] = []

        def join() -> None:
            try:
                ps.init_distributed(self.world_size, 0, init_method, self.device, timeout_s, self.pp_size,
                                    expert_parallel=self.expert_parallel)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                failure.append(e)

        t = threading.Thread(target=join, name="rooflm-tp-init", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            if t.is_alive():
                self.check_workers()
        if failure:
            self.shutdown()
            raise failure[0]

    # -- set-up, in the order the workers follow ---------------------------------------------------------------------
    def agree_num_blocks(self, num_blocks: int) -> int:
        """The KV pool size every rank can hold: the smallest of the ranks' own sizes."""
        return self._guard(ps.all_reduce_min, num_blocks)

    def start_runners(self, max_model_len: int, eos_token_ids: list[int]) -> None:
        """What the workers need from rank 0 to build their runners (rank 0 decides both)."""
        self._guard(ps.broadcast_object, (max_model_len, list(eos_token_ids)))

    # -- steps -----------------------------------------------------------------------------------------------------
    def execute(self, runner: "ModelRunner", out: "SchedulerOutput") -> "StepHandle":
        """Send ``out`` to every worker, then run it on rank 0's runner."""
        self.check_workers()
        payload = pickle.dumps(portable_output(out), protocol=pickle.HIGHEST_PROTOCOL)
        self._guard(self._send, payload)
        return self._guard(runner.execute, out)

    def _send(self, payload: bytes) -> None:
        for pipe in self.pipes:
            pipe.send_bytes(payload)

    def _guard(self, fn, *args):
        """Run ``fn``; a failure while a worker is dead becomes ``WorkerDiedError`` naming it. Any other failure also
        stops the workers: once one rank missed a step's collectives the ranks are out of step for good (and the
        workers would wait for rank 0 until the group's timeout)."""
        try:
            return fn(*args)
        except Exception as e:
            self.check_workers(grace_s=5.0)  # raises WorkerDiedError when a worker is gone
            self.error = f"rank 0 failed ({type(e).__name__}: {e}); the engine stopped the workers"
            self.shutdown()
            raise

    def check_workers(self, grace_s: float = 0.0) -> None:
        """Raise ``WorkerDiedError`` (after stopping the others) if a worker has exited. ``grace_s``: wait that long
        for a worker that is about to exit (a failed collective on rank 0 may be seen before the peer's exit)."""
        if self.error is None and grace_s > 0:
            from multiprocessing.connection import wait

            wait([p.sentinel for p in self.procs], timeout=grace_s)
        if self.error is None:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    self.error = (f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode} "
                                  "(a negative code is the signal that ended it); the engine stopped the other "
                                  "ranks and cannot continue")
                    break
        if self.error is not None:
            self.shutdown()
            raise WorkerDiedError(self.error)

    # -- shutdown ----------------------------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every worker (a stop message; then SIGTERM, then SIGKILL for one that does not exit) and leave the
        process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for pipe in self.pipes:
            try:
                pipe.send_bytes(b"")  # the stop message
            except OSError:
                pass  # that worker is gone already
            pipe.close()
        for p in self.procs:
            p.join(timeout_s if self.error is None else 1.0)  # after a failure a worker may be inside a collective
        stopped = []
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is None:
                stopped.append(rank)
                p.terminate()
                p.join(5.0)
            if p.exitcode is None:
                p.kill()
                p.join()
        if stopped:
            logger.warning("worker rank(s) %s did not exit within %.0f s of the stop message and were terminated",
                           stopped, timeout_s)
        if self.error is None and all(p.exitcode == 0 for p in self.procs):
            ps.destroy_distributed()
        else:
            ps.abandon_distributed()  # a peer is gone (failed, or stopped by a signal): a clean teardown would wait
        shutil.rmtree(self._store_dir, ignore_errors=True)
        _LIVE.discard(self)


@atexit.register
def _shutdown_all() -> None:
    for ex in list(_LIVE):
        ex.shutdown()
