"""The step contract: what the scheduler tells the model runner, and what comes back. Plain data.

Send once, then diffs (vLLM v1's ``NewRequestData`` / ``CachedRequestData``): a request's prompt, sampling
parameters and block table cross to the runner once, when it is (re)admitted; afterwards a step carries only the
block ids appended since the last step and the number of tokens to compute. The runner keeps everything else in its
persistent batch (``rooflm.worker.input_batch``). Requests that finished or were preempted since the last step are
named so the runner can drop their state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rooflm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: first admission, or resumption after preemption."""

    req_id: str
    token_ids: list[int]  # every token known now (prompt, plus outputs when resumed)
    num_prompt_tokens: int
    params: "SamplingParams"
    generator: "torch.Generator | None"
    block_ids: list[int]  # the whole table, covering this step's tokens
    num_computed_tokens: int  # before this step (prefix-cache hits)


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]  # appended to its table since the last step


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step, in batch order (new and cached requests interleaved as scheduled).
    num_scheduled_tokens: dict[str, int]
    # Requests whose last scheduled token ends at their known length: the step samples for each (one token, or with
    # draft tokens the accepted ones plus one).
    sampling_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: req_id -> draft tokens scheduled after the request's last token (verified this step).
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)  # since the last step: the runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), run before the forward pass
    # req_id -> num_computed_tokens once this step has run: the context length of its attention.
    num_computed_tokens_after: dict[str, int] = field(default_factory=dict)
    # Structured output: the sampling requests with a grammar, and their allowed-token bitmask ([G, ceil(V / 32)]
    # int32 on the host, row i for grammar_req_ids[i]), set by ``StructuredOutputManager.attach_bitmask``.
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: "torch.Tensor | None" = None
    # Swap preemption (rooflm.kv_cache.swap), run before the forward pass, swap-outs first:
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # KV compression (rooflm.kv_cache.compression): req_id -> the (table index, number of blocks) ranges dropped this
    # step, applied in order, before its new blocks are appended.
    kv_dropped: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # H2O KV compression: the requests whose per-block attention scores this step returns
    # (ModelRunnerOutput.block_scores).
    attn_score_req_ids: list[str] = field(default_factory=list)
    # The prefix cache's host tier (rooflm.kv_cache.host_tier): evicted cached blocks copied out (device block, host
    # block) before this step may reuse them, and host hits copied back (host block, device block) before it reads
    # them; offloads first, restores after the swap copies.
    kv_offload_out: list[tuple[int, int]] = field(default_factory=list)
    kv_offload_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    """What one step produced, on the host. Rows follow ``SchedulerOutput.sampling_req_ids``."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # per request: one token, or the accepted draft tokens plus one
    # Per row when the request asked for logprobs, else None: {token_id: logprob} (top-k plus the sampled one).
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    sampled_logprobs: list[float | None] = field(default_factory=list)
    # req_id -> [(prompt position, {token_id: logprob})] for the prompt positions computed this step.
    prompt_logprobs: dict[str, list[tuple[int, dict[int, float]]]] = field(default_factory=dict)
    # H2O: req_id -> attention probability mass per block of its table this step (SchedulerOutput.attn_score_req_ids)
    block_scores: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding with a draft model: req_id -> draft tokens proposed after this step, for the next one.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """One request's progress in one step, from ``Scheduler.update_from_output`` to the output processor."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    new_sampled_logprobs: list[float] = field(default_factory=list)
    new_prompt_logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
