"""Ranks 1..N-1 of a tensor-parallel engine: load this rank's shard, build a ``ModelRunner``, run each step rank 0
sends (``rooflm.distributed.executor``).

A worker repeats rank 0's set-up in the same order, because set-up has collectives (the sharded model's profiled
forward pass on CUDA, the KV pool size every rank agrees on, the runner's arguments): load the model, size the KV
pool from this rank's KV heads, take the smallest size over the ranks, receive ``max_model_len`` and the EOS ids.
Then, per step, it reads a pickled ``SchedulerOutput`` from its pipe and executes it; rank 0 reads the outputs, the
worker only keeps its ``InputBatch`` in step (``StepHandle.get()`` runs the host bookkeeping of verified draft
tokens). An empty message, or rank 0's end of the pipe closing, ends the loop.
"""
from __future__ import annotations

import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rooflm.distributed import parallel_state as ps

if TYPE_CHECKING:
    from rooflm.config import EngineConfig


def build_runner(config: "EngineConfig", device: torch.device):
    """Load this rank's shard and build its runner, following rank 0's set-up collectives."""
    from rooflm.distributed.executor import tp_cuda_graphs
    from rooflm.distributed.partition import shard_model_config
    from rooflm.engine.engine import kv_pool_blocks, resolve_dtype
    from rooflm.loader import load_model
    from rooflm.worker.model_runner import ModelRunner

    dtype = resolve_dtype(config.dtype, device)
    torch.manual_seed(config.seed)
    model, cfg = load_model(config.model, load_format=config.load_format, dtype=dtype, device=device,
                            attn_backend=config.attention_backend, ops=config.ops, seed=config.seed,
                            show_progress=False, quantization=config.quantization)
    state = ps.get_state()
    kv_cfg = shard_model_config(cfg, state.tp_size, state.tp_rank, state.pp_size, state.pp_rank)
    num_blocks = ps.all_reduce_min(kv_pool_blocks(config, model.eval(), kv_cfg, device, dtype))
    max_model_len, eos_token_ids = ps.broadcast_object(None)
    runner = ModelRunner(model, kv_cfg, num_blocks, config.block_size, device, dtype, config.max_num_seqs,
                         max_model_len, eos_token_ids, kv_cache_dtype=config.kv_cache_dtype)
    if device.type == "cuda" and not config.enforce_eager and tp_cuda_graphs(config):
        runner.capture_graphs(config.max_num_seqs)  # in step with rank 0's capture: the warm-up runs collectives
    return runner


def serve_steps(runner: Any, receive: Callable[[], bytes], device: torch.device, pipelined: bool = True) -> None:
    """Execute every step ``receive()`` returns (its pipe's ``recv_bytes``, or a broadcast from rank 0 under
    torchrun) until the stop message, or until ``EOFError`` (rank 0's end of the pipe closed).

    ``pipelined``: launch step N + 1 before waiting for step N's results, as rank 0 does under asynchronous
    scheduling. Waiting first would leave this rank's GPU idle while the host unpickles and prepares the next step,
    and every rank would wait for it at the step's first collective (rank 0 queues its steps ahead). A worker only
    needs a step's results on the host for speculative decoding (``StepHandle.get()`` then records the verified
    draft tokens before the next step), so the engine turns this off there."""
    from rooflm.distributed.executor import restore_output

    pending = None
    while True:
        try:
            payload = receive()
        except EOFError:
            return  # rank 0 is gone: its last step may never complete, so it is not waited for
        if not payload:
            if pending is not None:
                pending.get()
            return
        handle = runner.execute(restore_output(pickle.loads(payload), device))
        if pending is not None:
            pending.get()
        pending = handle
        if not pipelined:
            pending, _ = None, handle.get()


def run_worker(rank: int, world_size: int, init_method: str, config: "EngineConfig", device: torch.device, pipe: Any,
               timeout_s: float, pp_size: int = 1) -> None:
    """The worker process's entry point (spawned by ``MultiprocExecutor``)."""
    from rooflm.distributed.executor import threads_per_rank

    # Ctrl-C reaches the whole process group: rank 0 handles it and stops the workers (or, if it dies, its pipe
    # closes), so a worker ignores it rather than dying mid-collective with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(world_size))
        ps.init_distributed(world_size, rank, init_method, device, timeout_s, pp_size,
                            expert_parallel=config.enable_expert_parallel)
        with ps.building_sharded_model():
            runner = build_runner(config, device)
        serve_steps(runner, pipe.recv_bytes, device, pipelined=config.speculative_config is None)
    except BaseException:  # noqa: BLE001 - reported, then the exit code tells rank 0
        traceback.print_exc()
        sys.stderr.flush()
        ps.abandon_distributed()
        sys.exit(1)
    ps.destroy_distributed()
