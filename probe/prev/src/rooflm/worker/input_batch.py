"""The runner's persistent batch: per-request state that crossed from the scheduler once, updated in place.

Each request the runner holds owns a *row* (a slot in the persistent tensors) from admission until it finishes or is
preempted (vLLM v1's ``InputBatch``). Per row:
- the host block table (numpy, ``[max_rows, max_blocks]``), extended with the ids each step adds;
- ``last_token`` on the device: the token the row sampled last. Decode inputs are gathered from it on the device,
  so a sampled token feeds the next step without a round trip through the host (asynchronous scheduling);
- for rows with repetition/presence/frequency penalties only: generated-token counts and a prompt-token mask on the
  device (``[max_rows, vocab]``, allocated on first use), updated after each step from the sampled ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rooflm.sampling_params import SamplingParams

_ALIGN = 16  # bytes: each part starts where a fresh allocation would be aligned for vector loads


def upload(parts: list[np.ndarray], device: torch.device, pin: bool) -> list[torch.Tensor]:
    """The 1-D arrays ``parts`` on ``device`` through one host buffer and one copy (pinned when ``pin``, so the copy
    does not stall the host), each returned as a view of its own dtype: int64 and int32 inputs arrive as they are
    used, with no kernel after the copy to change a dtype (a decode step's inputs are a few hundred bytes, and each
    small kernel would cost about as long as the copy itself). Each part starts at a multiple of 16 bytes."""
    dtypes = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
    offsets, end = [], 0
    for i, a in enumerate(parts):
        if a.dtype not in dtypes or a.ndim != 1:
            raise ValueError(f"upload: part {i} is {a.dtype} of shape {a.shape}; expected a 1-D int64 or int32 array")
        offsets.append(end)
        end += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.zeros(max(end, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    buf = host.numpy()
    for a, o in zip(parts, offsets):
        buf[o:o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8)
    flat = host.to(device, non_blocking=pin)
    return [flat[o:o + a.nbytes].view(dtypes[a.dtype]) for a, o in zip(parts, offsets)]


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # known when the request (re)entered the runner; later samples live in last_token
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    num_tokens: int  # known tokens + tokens sampled since
    row: int
    penalties: bool
    pending_spec: list[int] = field(default_factory=list)  # draft tokens verified by the step in flight
    num_dropped: int = 0  # KV compression: positions dropped from the cache (position p is at cache index p - this)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


class InputBatch:
    def __init__(self, max_rows: int, max_blocks_per_seq: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.device = device
        self.reqs: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.block_table = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int64)
        self.last_token = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.output_counts: torch.Tensor | None = None  # [max_rows, vocab] int32, rows with penalties only
        self.prompt_mask: torch.Tensor | None = None  # [max_rows, vocab] bool

    def add(self, req_id: str, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams,
            generator: torch.Generator | None, block_ids: list[int], num_computed_tokens: int) -> CachedRequestState:
        if req_id in self.reqs:
            raise ValueError(f"the runner already holds request {req_id!r}")
        if not self._free_rows:
            raise RuntimeError(f"the runner's batch is full ({self.max_rows} rows)")
        if len(block_ids) > self.block_table.shape[1]:
            raise ValueError(f"request {req_id!r} has {len(block_ids)} blocks, more than max_blocks_per_seq="
                             f"{self.block_table.shape[1]}")
        row = self._free_rows.pop()
        state = CachedRequestState(req_id, token_ids, num_prompt_tokens, params, generator, list(block_ids),
                                   num_computed_tokens, len(token_ids), row, has_penalties(params))
        self.block_table[row, :len(block_ids)] = block_ids
        if state.penalties:
            self._init_penalty_row(state)
        self.reqs[req_id] = state
        return state

    def _init_penalty_row(self, s: CachedRequestState) -> None:
        from rooflm.layers.sampler import token_counts, token_mask

        if self.output_counts is None:
            # int32 counts: half the memory of int64, the same penalties.
            self.output_counts = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        outputs = [s.token_ids[s.num_prompt_tokens:]]
        self.output_counts[s.row].copy_(token_counts(outputs, self.vocab_size, self.device, torch.int32)[0])
        self.prompt_mask[s.row].copy_(token_mask([s.token_ids[:s.num_prompt_tokens]], self.vocab_size, self.device)[0])

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        s = self.reqs[req_id]
        n = len(s.block_ids)
        if n + len(block_ids) > self.block_table.shape[1]:
            raise ValueError(f"request {req_id!r} would hold {n + len(block_ids)} blocks, more than "
                             f"max_blocks_per_seq={self.block_table.shape[1]}")
        self.block_table[s.row, n:n + len(block_ids)] = block_ids
        s.block_ids.extend(block_ids)

    def drop_blocks(self, req_id: str, start: int, num_blocks: int, block_size: int) -> None:
        """KV compression: remove ``num_blocks`` table entries from index ``start`` on and close the gap."""
        s = self.reqs[req_id]
        del s.block_ids[start:start + num_blocks]
        self.block_table[s.row, :len(s.block_ids)] = s.block_ids
        s.num_dropped += num_blocks * block_size

    def remove(self, req_id: str) -> None:
        s = self.reqs.pop(req_id, None)
        if s is not None:
            self._free_rows.append(s.row)

    def record_sampled(self, rows: torch.Tensor, sampled: torch.Tensor, penalty_rows: list[int],
                       penalty_index: torch.Tensor | None) -> None:
        """After sampling (device tensors, no sync): ``last_token[rows] = sampled``; penalty rows count their token.
        ``penalty_index`` selects, among the sampled rows, those with penalties (persistent rows ``penalty_rows``)."""
        from rooflm.layers.sampler import add_tokens_to_counts

        self.last_token.index_copy_(0, rows, sampled)
        if penalty_rows and self.output_counts is not None and penalty_index is not None:
            add_tokens_to_counts(self.output_counts, rows.index_select(0, penalty_index),
                                 sampled.index_select(0, penalty_index))
