"""The OpenAI endpoints' logic: request → engine requests → JSON response or SSE stream.

Flow of one /v1/completions or /v1/chat/completions request:
1. validate what pydantic cannot (model name, prompt tokens within the vocabulary, context length, unsupported
   options) → 400 / 404 naming the field;
2. tokenize here (the engine gets token ids, so what was counted against ``max_model_len`` is what runs);
3. add one engine request per prompt (each carries the n samples) → 503 when the waiting queue is full;
4. gather the finished outputs, or stream deltas of the cumulative outputs as server-sent events ending with
   ``data: [DONE]``. A client that goes away (stream closed, or non-streaming connection dropped) aborts its
   engine requests, which frees their KV blocks.

Steps 1-2 live in ``openai_prepare`` (the ``_RequestPreparation`` mixin), the SSE plumbing in ``openai_sse``;
this module holds ``OpenAIServing``: engine hand-off, the endpoints, response rendering and streaming.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rooflm.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream
from rooflm.outputs import CompletionOutput, RequestOutput
from rooflm.server.errors import OpenAIError, bad_request, error_body, from_value_error
from rooflm.server.metrics import ABORTED, ERROR, SUCCESS, RequestTracker, ServerMetrics
from rooflm.server.openai_prepare import _Prepared, _RequestPreparation
from rooflm.server.openai_sse import _DONE, _AbortingStreamingResponse, _sse
from rooflm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

logger = logging.getLogger(__name__)

_MIN_LOGPROB = -9999.0  # JSON has no -inf: impossible tokens report this
_DISCONNECT_POLL_S = 0.5


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    if math.isnan(x) or x == -math.inf:
        return _MIN_LOGPROB
    return 0.0 if x == math.inf else float(x)


class OpenAIServing(_RequestPreparation):
    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.max_model_len = engine.max_model_len
        # The engine thread detokenizes with its tokenizer; the event loop gets its own copy, because a fast
        # tokenizer used from two threads at once can fail ("Already borrowed").
        try:
            self.tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:
            self.tokenizer = engine.tokenizer
        self.vocab_size = self._vocab_size()
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------------------------------------ facts
    def _vocab_size(self) -> int:
        sizes = []
        if self.tokenizer is not None:
            try:
                sizes.append(len(self.tokenizer))
            except TypeError:
                pass
        model_config = getattr(self.engine.engine, "model_config", None)
        if getattr(model_config, "vocab_size", None):
            sizes.append(int(model_config.vocab_size))
        return min(sizes) if sizes else 2**31

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rooflm",
                "root": self.model_name, "max_model_len": self.max_model_len}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._require_tokenizer().decode([token_id])
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text

    # ------------------------------------------------------------------------------------------------ engine
    async def _add_all(self, prep: _Prepared, response_id: str) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, (ids, params) in enumerate(zip(prep.prompts, prep.params)):
                streams.append(await self.engine.add_request(ids, params, request_id=f"{response_id}-{i}"))
        except BaseException as e:
            self._abort_all(streams)
            if isinstance(e, QueueFullError):
                raise OpenAIError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from None
            if isinstance(e, EngineDeadError):
                raise OpenAIError(503, f"the engine is not running: {e}", code="engine_unavailable") from None
            if isinstance(e, ValueError):
                raise from_value_error(e, prep.prompt_param) from None
            raise
        return streams

    def _abort_all(self, streams: list[RequestStream]) -> None:
        """Abort every request of ``streams`` still unfinished (a no-op for finished ones)."""
        for stream in streams:
            self.engine.abort(stream.request_id)

    async def _merge(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, cumulative output) from all streams until each has finished.
        Leaving early (close/cancel) aborts the unfinished ones."""
        if len(streams) == 1:  # the common case: no extra task
            gen = self.engine.iterate(streams[0])
            try:
                async for out in gen:
                    yield 0, out
            finally:
                await gen.aclose()
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            gen = self.engine.iterate(stream)
            try:
                async for out in gen:
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))
            finally:
                await gen.aclose()

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        unfinished = set(range(len(streams)))
        try:
            while unfinished:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(i)
                yield i, item
        finally:
            for t in tasks:
                t.cancel()  # a task cancelled before it ran never opened its iterator: abort explicitly too
            self._abort_all([streams[i] for i in unfinished])

    async def _collect(self, streams: list[RequestStream], tracker: RequestTracker) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        merged = self._merge(streams)
        try:
            async for i, out in merged:
                tracker.on_output(out)
                finals[i] = out
        finally:
            await merged.aclose()
        return [f for f in finals if f is not None]

    # ------------------------------------------------------------------------------------------------ endpoints
    async def create_completion(self, body: CompletionRequest, request: Request) -> Response:
        prep = self.prepare_completion(body)
        return await self._generate(prep, request, chat=False)

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request) -> Response:
        prep = self.prepare_chat(body)
        return await self._generate(prep, request, chat=True)

    async def _generate(self, prep: _Prepared, request: Request, chat: bool) -> Response:
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        tracker = self.metrics.tracker("chat_completions" if chat else "completions")
        streams = await self._add_all(prep, response_id)
        created = int(time.time())
        if prep.stream:
            gen = self._stream(prep, streams, tracker, response_id, created, chat)

            def on_close() -> None:
                self._abort_all(streams)
                tracker.finish(ABORTED)  # no-op when the stream already recorded its outcome

            return _AbortingStreamingResponse(gen, on_close, media_type="text/event-stream",
                                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        task = asyncio.ensure_future(self._collect(streams, tracker))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    break
                if await request.is_disconnected():  # nobody will read the answer: free the engine
                    task.cancel()
                    self._abort_all(streams)
                    tracker.finish(ABORTED)
                    return Response(status_code=499)
        except BaseException:
            task.cancel()
            self._abort_all(streams)
            tracker.finish(ABORTED)
            raise
        try:
            finals = task.result()
        except EngineDeadError as e:
            tracker.finish(ERROR)
            raise OpenAIError(503, f"the engine stopped while generating: {e}", code="engine_unavailable") from None
        tracker.finish(SUCCESS)
        body = self._chat_response(prep, finals, response_id, created) if chat else \
            self._completion_response(prep, finals, response_id, created)
        return JSONResponse(body)

    # ------------------------------------------------------------------------------------------------ responses
    def _usage(self, prep: _Prepared, finals: Sequence[RequestOutput | None]) -> dict[str, int]:
        prompt = sum(len(f.prompt_token_ids) if f is not None and f.prompt_token_ids else len(p)
                     for f, p in zip(finals, prep.prompts))
        completion = sum(len(o.token_ids) for f in finals if f is not None for o in f.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _completion_logprobs(self, o: CompletionOutput, start: int, k: int, offset: int) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float | None]] = []
        offsets: list[int] = []
        for pos in range(start, len(o.token_ids)):
            tid = o.token_ids[pos]
            d = o.logprobs[pos] if o.logprobs is not None and pos < len(o.logprobs) else {}
            text = self.token_text(tid)
            tokens.append(text)
            token_logprobs.append(_finite(d.get(tid)))
            best = sorted(d.items(), key=lambda kv: -kv[1])[:k]
            top.append({self.token_text(t): _finite(lp) for t, lp in best})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, o: CompletionOutput, start: int, k: int) -> dict[str, Any]:
        content = []
        for pos in range(start, len(o.token_ids)):
            tid = o.token_ids[pos]
            d = o.logprobs[pos] if o.logprobs is not None and pos < len(o.logprobs) else {}
            best = sorted(d.items(), key=lambda kv: -kv[1])[:k]
            text = self.token_text(tid)
            content.append({
                "token": text, "logprob": _finite(d.get(tid, _MIN_LOGPROB)), "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": self.token_text(t), "logprob": _finite(lp),
                                  "bytes": list(self.token_text(t).encode("utf-8"))} for t, lp in best],
            })
        return {"content": content}

    def _completion_response(self, prep: _Prepared, finals: list[RequestOutput], rid: str,
                             created: int) -> dict[str, Any]:
        choices = []
        for i, final in enumerate(finals):
            for o in final.outputs:
                prefix = prep.prompt_texts[i] if prep.echo else ""
                choices.append({
                    "index": i * prep.n + o.index,
                    "text": prefix + o.text,
                    "logprobs": None if prep.logprobs is None else self._completion_logprobs(
                        o, 0, prep.logprobs, len(prefix)),
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                })
        choices.sort(key=lambda c: c["index"])
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self._usage(prep, finals), "system_fingerprint": None}

    def _chat_response(self, prep: _Prepared, finals: list[RequestOutput], rid: str, created: int) -> dict[str, Any]:
        choices = []
        for o in finals[0].outputs:
            choices.append({
                "index": o.index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": None if prep.logprobs is None else self._chat_logprobs(o, 0, prep.logprobs),
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            })
        choices.sort(key=lambda c: c["index"])
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self._usage(prep, finals), "system_fingerprint": None}

    async def _stream(self, prep: _Prepared, streams: list[RequestStream], tracker: RequestTracker, rid: str,
                      created: int, chat: bool) -> AsyncIterator[str]:
        """SSE body. Invariant: per choice, the concatenated deltas equal the non-streamed text, because the
        engine's cumulative text only grows and each delta is its new suffix."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent_text: dict[tuple[int, int], int] = {}  # (prompt, sample) → characters sent
        sent_tokens: dict[tuple[int, int], int] = {}  # → tokens whose logprobs were sent
        offsets: dict[tuple[int, int], int] = {}  # completions' text_offset so far
        done: set[tuple[int, int]] = set()
        finals: list[RequestOutput | None] = [None] * len(streams)

        def chunk(choice: dict[str, Any]) -> str:
            data: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                                    "choices": [choice]}
            if prep.include_usage:
                data["usage"] = None
            return _sse(data)

        merged = self._merge(streams)
        try:
            if chat:  # the role comes first, once per choice
                for j in range(prep.n):
                    yield chunk({"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})
            async for i, out in merged:
                tracker.on_output(out)
                finals[i] = out
                for o in out.outputs:
                    key = (i, o.index)
                    if key in done:
                        continue
                    first = key not in sent_text
                    start = sent_text.get(key, 0)
                    delta = o.text[start:] if len(o.text) >= start else ""
                    if prep.echo and first:
                        delta = prep.prompt_texts[i] + delta
                    if not delta and o.finish_reason is None:
                        continue  # held back (partial character or possible stop string): wait for more
                    tok_start = sent_tokens.get(key, 0)
                    sent_text[key] = max(len(o.text), start)
                    sent_tokens[key] = len(o.token_ids)
                    index = i * prep.n + o.index
                    if chat:
                        choice: dict[str, Any] = {
                            "index": index, "delta": {"content": delta} if delta else {},
                            "logprobs": None if prep.logprobs is None else self._chat_logprobs(
                                o, tok_start, prep.logprobs),
                            "finish_reason": o.finish_reason}
                    else:
                        lp = None
                        if prep.logprobs is not None:
                            lp = self._completion_logprobs(o, tok_start, prep.logprobs, offsets.get(key, 0))
                            offsets[key] = offsets.get(key, 0) + sum(len(t) for t in lp["tokens"])
                        choice = {"index": index, "text": delta, "logprobs": lp, "finish_reason": o.finish_reason}
                    if o.finish_reason is not None:
                        choice["stop_reason"] = o.stop_reason
                        done.add(key)
                    yield chunk(choice)
            if prep.include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                            "usage": self._usage(prep, finals)})
            yield _DONE
            tracker.finish(SUCCESS)
        except EngineDeadError as e:
            tracker.finish(ERROR)
            yield _sse(error_body(f"the engine stopped while generating: {e}", "service_unavailable_error",
                                  None, "engine_unavailable"))
            yield _DONE
        finally:
            await merged.aclose()  # aborts the engine requests still unfinished (client gone)
            tracker.finish(ABORTED)  # no-op unless the client left before the end

    # ------------------------------------------------------------------------------------------------ tokenizer
    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages must not be empty", param="messages")
            ids = self.render_chat(body.messages, body.add_generation_prompt is not False)
        else:
            ids = list(self._require_tokenizer().encode(body.prompt, add_special_tokens=body.add_special_tokens
                                                        is not False))
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        self._check_ids(body.tokens, "tokens")
        return {"prompt": self._require_tokenizer().decode(body.tokens)}
