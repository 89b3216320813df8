"""Swap preemption: a preempted request's KV blocks go to host memory and come back when it resumes.

vLLM's two preemption modes (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", section 4.5): *recompute* frees a victim's blocks and computes its whole context again on resume;
*swap* copies the blocks to a host buffer (``swap_space`` GiB) and back into fresh device blocks on resume, so the
victim's context is never computed twice. Which is cheaper depends on the context length and the machine: recompute
costs one prefill of the context (compute-bound, roughly linear in its length), swap costs two transfers of its KV
over the host link (bandwidth-bound, linear too). ``auto`` compares the two per victim (``choose_swap``).

This module is the scheduler's side, pure Python like the rest of ``rooflm.kv_cache``: it owns the host block ids,
remembers which host blocks hold which preempted request, and queues the copies. The scheduler puts them in
``SchedulerOutput.blocks_to_swap_out`` / ``blocks_to_swap_in``; the runner performs them before the step's forward
pass, swap-outs first (a victim's device blocks may be handed to another request in the same step), then swap-ins.
Host blocks released by a swap-in become free only after the step's output is built, so a swap-out in the same step
never targets a host block a swap-in still reads.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from rooflm.config import PREEMPTION_MODES

__all__ = ["PREEMPTION_MODES", "SwapManager", "choose_swap", "DEFAULT_HOST_BANDWIDTH"]

# Host <-> device bytes per second assumed when nothing was measured: about what a PCIe 4.0 x16 link sustains for
# pinned copies (its 32 GB/s peak less protocol overhead), and on a CPU-only machine the order of a memcpy's speed.
DEFAULT_HOST_BANDWIDTH = {"cuda": 25e9, "cpu": 10e9}


def choose_swap(recompute_seconds: float, swap_bytes: int, bandwidth: float) -> bool:
    """``auto``'s rule: swap when recomputing the context would take longer than moving its KV out and back in.

    ``recompute_seconds`` is the roofline's best time of a prefill over the victim's context (the live roofline's
    prediction); the swap costs ``2 * swap_bytes / bandwidth`` (out now, in on resume). Both are lower bounds, so
    the comparison is between like quantities."""
    return recompute_seconds > 2 * swap_bytes / bandwidth


@dataclass
class SwapStats:
    swap_outs: int = 0  # preemptions that swapped
    recomputes: int = 0  # preemptions that recomputed (by mode, by the rule, or because the host pool was full)
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0


class SwapManager:
    """Host block bookkeeping for swap preemption.

    ``mode``: "swap" swaps every victim whose blocks fit the host pool (else recomputes it), "auto" decides per victim
    with ``choose_swap``, "recompute" never swaps. ``recompute_seconds(num_tokens)`` and ``bytes_per_block`` feed the
    rule; ``bandwidth`` is host <-> device bytes per second."""

    def __init__(self, num_host_blocks: int, mode: str = "swap", bytes_per_block: int = 1,
                 recompute_seconds: Callable[[int], float] | None = None, bandwidth: float = 25e9) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={mode!r} is invalid: expected one of {PREEMPTION_MODES}")
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks={num_host_blocks!r} is invalid: expected an integer >= 0")
        if mode == "auto" and recompute_seconds is None:
            raise ValueError("preemption_mode='auto' needs a recompute cost (recompute_seconds)")
        self.mode = mode
        self.num_host_blocks = num_host_blocks
        self.bytes_per_block = bytes_per_block
        self.recompute_seconds = recompute_seconds
        self.bandwidth = bandwidth
        # a min-heap: the lowest free ids first, so a request's host blocks form long runs of consecutive ids, each
        # copied as one transfer (rooflm.worker.swap_space.host_runs)
        self._free: list[int] = list(range(num_host_blocks))
        self._released: list[int] = []  # freed by this step's swap-ins: free once the step's output is built
        self.swapped: dict[str, list[int]] = {}  # request id -> its host blocks, in token order
        self._out: list[tuple[int, int]] = []  # (device block, host block)
        self._in: list[tuple[int, int]] = []  # (host block, device block)
        self.stats = SwapStats()

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free)

    def holds(self, req_id: str) -> bool:
        return req_id in self.swapped

    def should_swap(self, num_blocks: int, num_tokens: int) -> bool:
        """Whether a victim with ``num_blocks`` blocks of computed KV (``num_tokens`` tokens) is swapped."""
        if self.mode == "recompute" or num_blocks == 0 or num_blocks > len(self._free):
            return False
        if self.mode == "swap":
            return True
        return choose_swap(self.recompute_seconds(num_tokens), num_blocks * self.bytes_per_block, self.bandwidth)

    def swap_out(self, req_id: str, device_block_ids: list[int]) -> None:
        """Queue the copy of ``device_block_ids`` into fresh host blocks (the caller checked ``should_swap``)."""
        if req_id in self.swapped:
            raise ValueError(f"request {req_id!r} is already swapped out")
        host = [heapq.heappop(self._free) for _ in device_block_ids]
        self.swapped[req_id] = host
        self._out.extend(zip(device_block_ids, host))
        self.stats.swap_outs += 1
        self.stats.blocks_swapped_out += len(host)

    def num_blocks_of(self, req_id: str) -> int:
        return len(self.swapped[req_id])

    def swap_in(self, req_id: str, device_block_ids: list[int]) -> None:
        """Queue the copy of ``req_id``'s host blocks into ``device_block_ids`` (as many, in token order)."""
        host = self.swapped.pop(req_id)
        if len(device_block_ids) != len(host):
            raise ValueError(f"swap_in({req_id!r}): {len(device_block_ids)} device blocks for {len(host)} host blocks")
        self._in.extend(zip(host, device_block_ids))
        self._released.extend(host)
        self.stats.blocks_swapped_in += len(host)

    def drop(self, req_id: str) -> None:
        """A swapped-out request finished (aborted) before resuming: its host blocks are free again."""
        host = self.swapped.pop(req_id, None)
        if host is not None:
            self._give_back(host)

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (swap-out, swap-in) copies; the host blocks the swap-ins read become free from now on."""
        out, inn = self._out, self._in
        self._out, self._in = [], []
        self._give_back(self._released)
        self._released = []
        return out, inn

    def _give_back(self, host_ids: list[int]) -> None:
        for h in host_ids:
            heapq.heappush(self._free, h)
