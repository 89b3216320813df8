"""What the engine returns: vLLM's output shapes.

Logprobs: for each generated token (or prompt position) a dict ``{token_id: logprob}`` holding the top-k tokens and
always the chosen (or actual) token. ``prompt_logprobs[0]`` is ``None`` (the first token has no context).
"""
from __future__ import annotations

from dataclasses import dataclass

Logprobs = list[dict[int, float]]
PromptLogprobs = list[dict[int, float] | None]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Logprobs | None = None
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when added
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
