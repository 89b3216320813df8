"""The output processor: from the scheduler's per-step token deltas to the user's ``RequestOutput``s.

It owns everything the scheduler does not need: detokenization, stop strings, logprob lists, timestamps, and the
fan-in of ``n > 1``. A parent request with ``n`` samples becomes ``n`` child requests at the front door (vLLM v1's
``ParentRequest``); each child is scheduled on its own and shares the prompt's KV through the prefix cache. Here the
children's outputs are gathered back into one ``RequestOutput`` with ``n`` completions.

A stop string ends a child here, since only detokenized text can show it; the engine then tells the scheduler to
finish that request (``Scheduler.finish_requests``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rooflm.engine.sched_output import EngineCoreOutput
from rooflm.engine.stop_checker import FINISH_STOP, is_stop_token
from rooflm.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from rooflm.sampling_params import SamplingParams


@dataclass
class ChildState:
    req_id: str
    index: int
    params: SamplingParams
    metrics: RequestMetrics
    detokenizer: Any = None  # IncrementalDetokenizer, when the model has a tokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # stream-safe: only grows
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState]
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def to_output(self) -> RequestOutput:
        metrics = self.children[0].metrics
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=[c.to_output() for c in self.children], finished=self.finished,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            metrics=metrics, num_cached_tokens=metrics.num_cached_tokens)


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.parents: dict[str, ParentState] = {}
        self._child_to_parent: dict[str, tuple[ParentState, ChildState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    child_params: list[SamplingParams], metrics: list[RequestMetrics]) -> list[str]:
        """Register a parent and its children (one per sample); returns the child request ids."""
        from rooflm.engine.detokenizer import IncrementalDetokenizer

        ids = child_request_ids(request_id, len(child_params))
        children = []
        for i, (cid, cp, m) in enumerate(zip(ids, child_params, metrics)):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, cp) if self.tokenizer is not None else None
            children.append(ChildState(cid, i, cp, m, detok, logprobs=[] if cp.logprobs is not None else None))
        parent = ParentState(request_id, prompt, prompt_token_ids, children,
                             [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)
        self.parents[request_id] = parent
        for c in children:
            self._child_to_parent[c.req_id] = (parent, c)
        return ids

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.req_id for c in parent.children if c.finish_reason is None] if parent else []

    def abort(self, request_id: str) -> None:
        """Forget a parent (its children are finished by the scheduler)."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for c in parent.children:
                self._child_to_parent.pop(c.req_id, None)

    def process(self, core_outputs: list[EngineCoreOutput], now: float) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Apply one step's deltas. Returns the outputs of parents whose children got tokens or finished, and the
        (child id, stop string) pairs the scheduler must finish."""
        progressed: dict[str, ParentState] = {}
        to_stop: list[tuple[str, str]] = []
        for o in core_outputs:
            entry = self._child_to_parent.get(o.req_id)
            if entry is None:
                continue
            parent, child = entry
            if o.new_prompt_logprobs and parent.prompt_logprobs is not None:
                for pos, d in o.new_prompt_logprobs:
                    parent.prompt_logprobs[pos] = d
            if not o.new_token_ids and o.finish_reason is None:
                continue
            stop_str = self._append(child, o)
            if stop_str is not None and o.finish_reason in (None, "length"):
                # A stop string outranks max_tokens (vLLM's order); the scheduler may not know yet.
                if o.finish_reason is None:
                    to_stop.append((child.req_id, stop_str))
                child.finish_reason, child.stop_reason = FINISH_STOP, stop_str
            elif o.finish_reason is not None:
                child.finish_reason, child.stop_reason = o.finish_reason, o.stop_reason
            m = child.metrics
            if o.new_token_ids:
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
            if child.finish_reason is not None:
                if child.detokenizer is not None:
                    child.text += child.detokenizer.flush()
                m.finished_time = now
            progressed[parent.request_id] = parent
        outputs = []
        for parent in progressed.values():
            outputs.append(parent.to_output())
            if parent.finished:
                self.abort(parent.request_id)
        return outputs, to_stop

    def _append(self, child: ChildState, o: EngineCoreOutput) -> str | None:
        """Append the new tokens to the child's output; returns a stop string if one appeared."""
        for j, token in enumerate(o.new_token_ids):
            child.token_ids.append(token)
            if child.logprobs is not None and j < len(o.new_logprobs):
                child.logprobs.append(o.new_logprobs[j])
                child.cumulative_logprob += o.new_sampled_logprobs[j]
            if child.detokenizer is not None:
                ends = is_stop_token(token, len(child.token_ids), child.params, self.eos_token_ids)
                stop_str = child.detokenizer.append(token, is_stop_token=ends)
                child.text += child.detokenizer.get_delta()
                if stop_str is not None:
                    return stop_str
        return None
