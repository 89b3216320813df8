"""A request as the scheduler sees it: one prompt, one sample, its tokens and how many of them have KV.

``n > 1`` never reaches the scheduler: the engine's front door fans a parent request out into ``n`` child requests
(``rooflm.engine.output_processor``), which share the prompt's KV through the prefix cache.

Invariants:
- ``0 <= num_computed_tokens <= num_tokens``, where ``num_tokens = len(all_token_ids) + num_output_placeholders``.
  Tokens ``[num_computed_tokens, num_tokens)`` have no KV in the cache yet.
- ``num_computed_tokens`` advances when a step is *scheduled* (vLLM v1's rule), so the next step can be scheduled
  before this one has run. A step that ends at ``num_tokens`` samples a token; until the host reads it back, the
  token is an *output placeholder* (its id lives only on the device, where the runner feeds it to the next step).
  Synchronous stepping reads it back before the next schedule, so it has no placeholder at scheduling time.
- ``block_hashes[i]`` is the chained hash of full block ``i`` of the known tokens; computed once, extended as tokens
  become known (``update_block_hashes``).
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from rooflm.kv_cache.hashing import hash_block
from rooflm.outputs import RequestMetrics
from rooflm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed (or swapped out); its tokens are kept
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 metrics: RequestMetrics | None = None, generator: "torch.Generator | None" = None) -> None:
        if params.n != 1:
            raise ValueError(f"Request {request_id!r}: n={params.n}; the engine fans n > 1 out before scheduling")
        self.request_id = request_id
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # sampled on the device, not read back yet
        self.status = RequestStatus.WAITING
        self.metrics = metrics or RequestMetrics(arrival_time=0.0)
        self.generator = generator  # seeded requests draw from their own generator
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []  # draft tokens to verify in the next step (speculative decoding)
        self.prompt_high_water = 0  # prompt positions computed at least once (for the prompt-token counter)
        self.arrival_index = 0  # the order the scheduler received it in (scheduling policies break ties by it)
        # KV compression (rooflm.kv_cache.compression): tokens whose KV was dropped from the middle of the context;
        # the request's cache holds num_computed_tokens - num_dropped_tokens tokens.
        self.num_dropped_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the ones sampled but not read back yet."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def update_block_hashes(self, block_size: int) -> list[int]:
        """Extend ``block_hashes`` over every full block of the known tokens; each block is hashed once."""
        n_full = len(self.all_token_ids) // block_size
        parent = self.block_hashes[-1] if self.block_hashes else None
        for i in range(len(self.block_hashes), n_full):
            parent = hash_block(parent, self.all_token_ids[i * block_size:(i + 1) * block_size])
            self.block_hashes.append(parent)
        return self.block_hashes

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, prompt={self.num_prompt_tokens})")
