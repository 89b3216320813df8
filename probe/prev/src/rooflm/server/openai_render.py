"""Rendering engine outputs into the OpenAI response shapes: logprobs in the legacy completions layout (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``; with ``echo`` the prompt's tokens come first and the first
one has ``null``, as it has no context), the chat layout, vLLM's ``prompt_logprobs``, and the full responses.

``_ResponseRendering`` is a mixin of ``OpenAIServing``: it reads ``model_name`` and ``token_text`` from the
instance."""
from __future__ import annotations

import math
from typing import Any, Sequence

from rooflm.outputs import CompletionOutput, RequestOutput
from rooflm.server.openai_prepare import _Prepared

_MIN_LOGPROB = -9999.0  # JSON has no -inf: impossible tokens report this

# One position: its token id and the engine's {token_id: logprob} there (None: no context, the first prompt token).
Entry = tuple[int, "dict[int, float] | None"]


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    if math.isnan(x) or x == -math.inf:
        return _MIN_LOGPROB
    return 0.0 if x == math.inf else float(x)


def _top(d: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: -kv[1])[:k]


class _ResponseRendering:
    model_name: str
    tool_parser: Any  # rooflm.structured.tool_parsers.ToolParser: reads calls out of the output

    def token_text(self, token_id: int) -> str:  # provided by OpenAIServing
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ positions
    @staticmethod
    def prompt_entries(final: RequestOutput | None, prompt_ids: Sequence[int]) -> list[Entry]:
        pl = final.prompt_logprobs if final is not None else None
        return [(t, pl[p] if pl is not None and p < len(pl) else None) for p, t in enumerate(prompt_ids)]

    @staticmethod
    def output_entries(o: CompletionOutput, start: int = 0) -> list[Entry]:
        return [(o.token_ids[p], o.logprobs[p] if o.logprobs is not None and p < len(o.logprobs) else {})
                for p in range(start, len(o.token_ids))]

    # ------------------------------------------------------------------------------------------------ layouts
    def legacy_logprobs(self, entries: Sequence[Entry], k: int, offset: int) -> dict[str, Any]:
        """OpenAI's completions layout; positions without context get ``null`` logprob and top_logprobs."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float | None] | None] = []
        offsets: list[int] = []
        for tid, d in entries:
            text = self.token_text(tid)
            tokens.append(text)
            if d is None:
                token_logprobs.append(None)
                top.append(None)
            else:
                token_logprobs.append(_finite(d.get(tid, -math.inf)))
                top.append({self.token_text(t): _finite(lp) for t, lp in _top(d, k)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(self, o: CompletionOutput, start: int, k: int) -> dict[str, Any]:
        content = []
        for tid, d in self.output_entries(o, start):
            text = self.token_text(tid)
            content.append({
                "token": text, "logprob": _finite(d.get(tid, _MIN_LOGPROB)), "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": self.token_text(t), "logprob": _finite(lp),
                                  "bytes": list(self.token_text(t).encode("utf-8"))} for t, lp in _top(d, k)],
            })
        return {"content": content}

    def vllm_prompt_logprobs(self, entries: Sequence[Entry], k: int) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per position ``{token id: {logprob, rank, decoded_token}}`` with the prompt's
        token and the top-k; ``rank`` is 1-based among the top-k, ``null`` for a prompt token outside them."""
        result: list[dict[str, Any] | None] = []
        for tid, d in entries:
            if d is None:
                result.append(None)
                continue
            best = _top(d, k)
            item = {str(t): {"logprob": _finite(lp), "rank": r, "decoded_token": self.token_text(t)}
                    for r, (t, lp) in enumerate(best, start=1)}
            if str(tid) not in item:
                item[str(tid)] = {"logprob": _finite(d.get(tid, -math.inf)), "rank": None,
                                  "decoded_token": self.token_text(tid)}
            result.append(item)
        return result

    # ------------------------------------------------------------------------------------------------ responses
    def usage(self, prep: _Prepared, finals: Sequence[RequestOutput | None]) -> dict[str, int]:
        prompt = sum(len(f.prompt_token_ids) if f is not None and f.prompt_token_ids else len(p)
                     for f, p in zip(finals, prep.prompts))
        completion = 0 if prep.echo_only else sum(len(o.token_ids) for f in finals if f is not None
                                                  for o in f.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def completion_choice_logprobs(self, prep: _Prepared, final: RequestOutput, i: int, o: CompletionOutput,
                                   start: int, offset: int, with_prompt: bool) -> dict[str, Any] | None:
        if prep.logprobs is None:
            return None
        entries = self.prompt_entries(final, prep.prompts[i]) if with_prompt else []
        if not prep.echo_only:
            entries += self.output_entries(o, start)
        return self.legacy_logprobs(entries, prep.logprobs, offset)

    def completion_response(self, prep: _Prepared, finals: list[RequestOutput], rid: str,
                            created: int) -> dict[str, Any]:
        choices = []
        for i, final in enumerate(finals):
            for o in final.outputs:
                prefix = prep.prompt_texts[i] if prep.echo else ""
                choice: dict[str, Any] = {
                    "index": i * prep.n + o.index,
                    "text": prefix + ("" if prep.echo_only else o.text),
                    "logprobs": self.completion_choice_logprobs(prep, final, i, o, 0, 0, prep.echo),
                    "finish_reason": "length" if prep.echo_only else o.finish_reason,
                    "stop_reason": None if prep.echo_only else o.stop_reason,
                }
                if prep.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.vllm_prompt_logprobs(
                        self.prompt_entries(final, prep.prompts[i]), prep.prompt_logprobs)
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self.usage(prep, finals), "system_fingerprint": None}

    def chat_response(self, prep: _Prepared, finals: list[RequestOutput], rid: str, created: int) -> dict[str, Any]:
        choices = []
        for o in finals[0].outputs:
            message: dict[str, Any] = {"role": "assistant", "content": o.text}
            finish_reason = o.finish_reason
            if prep.tool_names:
                content, calls = self.tool_parser.parse(o.text, prep.tool_names)
                if calls:
                    message = {"role": "assistant", "content": content if content.strip() else None,
                               "tool_calls": [c.to_openai() for c in calls]}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choices.append({
                "index": o.index,
                "message": message,
                "logprobs": None if prep.logprobs is None else self.chat_logprobs(o, 0, prep.logprobs),
                "finish_reason": finish_reason,
                "stop_reason": o.stop_reason,
            })
        choices.sort(key=lambda c: c["index"])
        body = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self.usage(prep, finals), "system_fingerprint": None}
        if prep.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(self.prompt_entries(finals[0], prep.prompts[0]),
                                                                prep.prompt_logprobs)
        return body
