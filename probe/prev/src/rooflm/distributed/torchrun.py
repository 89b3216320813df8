"""Launch under ``torchrun``: every rank runs the user's script, and ``LLM(..., tensor_parallel_size=N)`` (or
``pipeline_parallel_size=N``) finds the process group in the environment instead of starting workers.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/MASTER_PORT for each process it starts. Rank 0 runs the
engine as usual; on every other rank the ``LLM`` constructor becomes the worker loop and, when rank 0 shuts its engine
down, ends the process (exit code 0): the rest of the script runs on rank 0 only. Steps reach the workers as a
broadcast over the CPU group, whose timeout is long enough for an idle engine. A rank that fails is torchrun's to
handle: its agent stops the other ranks.

    torchrun --nproc-per-node 2 my_script.py        # my_script.py: LLM(model, tensor_parallel_size=2).generate(...)
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import torch

from rooflm.distributed import parallel_state as ps
from rooflm.distributed.executor import _LIVE, MultiprocExecutor, WorkerDiedError, rank_device, threads_per_rank

if TYPE_CHECKING:
    from rooflm.config import EngineConfig

IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # how long a worker waits for the next step


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process for more than one rank, else None."""
    if "MASTER_ADDR" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


class TorchrunExecutor(MultiprocExecutor):
    """Rank 0's side under torchrun (the same interface as ``MultiprocExecutor``, without processes of its own)."""

    def __init__(self, config: "EngineConfig", device: torch.device, rank: int, world_size: int, local_rank: int,
                 timeout_s: float = 600.0) -> None:
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.pp_size = config.pipeline_parallel_size
        if world_size != self.world_size:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} x pipeline_parallel_size="
                             f"{config.pipeline_parallel_size} does not match torchrun's WORLD_SIZE={world_size}")
        if ps.get_state() is not None:
            raise RuntimeError("this process already belongs to a process group")
        self.device = rank_device(device, local_rank)
        self.error = None
        self._closed = False
        self.procs, self.pipes = [], []
        if self.device.type == "cpu":
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
            torch.set_num_threads(threads_per_rank(local_world))
        ps.init_distributed(world_size, rank, "env://", self.device, timeout_s, self.pp_size,
                            control_timeout_s=IDLE_TIMEOUT_S, expert_parallel=config.enable_expert_parallel)
        if rank > 0:
            self._serve(config)
        _LIVE.add(self)  # interpreter exit sends the stop message

    def _serve(self, config: "EngineConfig") -> None:
        """A worker's whole life: build its runner, run the steps, leave the group, end the process."""
        from rooflm.distributed.worker import build_runner, serve_steps

        try:
            with ps.building_sharded_model():
                runner = build_runner(config, self.device)
            serve_steps(runner, lambda: ps.broadcast_object(None), self.device,
                        pipelined=config.speculative_config is None)
        finally:
            ps.destroy_distributed()
        sys.exit(0)

    def _send(self, payload: bytes) -> None:
        ps.broadcast_object(payload)

    def check_workers(self, grace_s: float = 0.0) -> None:
        if self.error is not None:
            raise WorkerDiedError(self.error)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Send the workers the stop message (they leave the group and exit) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if self.error is None:
            try:
                ps.broadcast_object(b"")
            finally:
                ps.destroy_distributed()
        else:
            ps.abandon_distributed()
        _LIVE.discard(self)
