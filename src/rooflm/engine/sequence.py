"""A request and its sequences.

A ``Request`` is what a user asked for: one prompt and its ``SamplingParams``. It owns ``n`` ``Sequence``s, one per
sample. Sample 0 (the leader) computes the prompt; at the step where the prompt's last token is computed, the other
samples are forked from it (sharing its KV blocks, copy-on-write) and each draws its own first token from the same
logits. After that every sequence is scheduled on its own.

Invariant: ``0 <= num_computed_tokens <= num_tokens``; the tokens ``all_token_ids[num_computed_tokens:]`` have no
KV in the cache yet. A running decode sequence has exactly one such token: the one it sampled last step.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rooflm.outputs import CompletionOutput, Logprobs, PromptLogprobs, RequestMetrics, RequestOutput
from rooflm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from rooflm.engine.detokenizer import IncrementalDetokenizer


class SeqStatus(enum.Enum):
    WAITING_FOR_FORK = "waiting_for_fork"  # a sample > 0 before its leader has computed the prompt
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: "Request", index: int) -> None:
        self.request = request
        self.index = index
        self.seq_id = request.request_id if request.params.n == 1 else f"{request.request_id}#{index}"
        self.all_token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SeqStatus.WAITING if index == 0 else SeqStatus.WAITING_FOR_FORK
        self.generator: torch.Generator | None = None  # set by the engine for seeded requests
        self.detokenizer: IncrementalDetokenizer | None = None
        self.logprobs: Logprobs | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob: float = 0.0
        self.text = ""  # stream-safe output text: only grows while running (the engine appends detokenizer deltas)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=self.output_token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, status={self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, prompt={self.num_prompt_tokens})")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    # prompt_logprobs[i] is the logprob dict of prompt token i given tokens < i; [0] is None.
    prompt_logprobs: PromptLogprobs | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.seqs = [Sequence(self, i) for i in range(self.params.n)]
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def leader(self) -> Sequence:
        return self.seqs[0]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.to_output() for s in self.seqs],
            finished=self.finished,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            metrics=self.metrics,
            num_cached_tokens=self.metrics.num_cached_tokens,
        )
