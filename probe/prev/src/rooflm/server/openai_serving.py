"""The OpenAI endpoints' logic: request → engine requests → JSON response or SSE stream.

Flow of one /v1/completions or /v1/chat/completions request:
1. validate what pydantic cannot (model name, prompt tokens within the vocabulary, context length, unsupported
   options) → 400 / 404 naming the field;
2. tokenize here (the engine gets token ids, so what was counted against ``max_model_len`` is what runs);
3. add one engine request per prompt (each carries the n samples) → 503 when the waiting queue is full;
4. gather the finished outputs, or stream deltas of the cumulative outputs as server-sent events ending with
   ``data: [DONE]``. A client that goes away (stream closed, or non-streaming connection dropped) aborts its
   engine requests, which frees their KV blocks.

Steps 1-2 live in ``openai_prepare`` (the ``_RequestPreparation`` mixin), response shapes in ``openai_render``,
the SSE plumbing in ``openai_sse``; this module holds ``OpenAIServing``: engine hand-off, the endpoints and
streaming.

Nothing slow runs on the event loop: JSON parsing, validation, tokenization and rendering of large responses run in
a bounded pool of threads (``prep_workers``), each thread with its own copy of the tokenizer (a fast tokenizer used
from two threads at once can fail with "Already borrowed"). So ``/health`` and every stream keep answering while a
huge prompt is being tokenized or refused.

When the server must stop before the requests finished (``--shutdown-timeout`` ran out, or a second signal),
``cut_streams()`` ends every stream with an OpenAI-style error event and ``data: [DONE]`` and answers every waiting
non-streaming request with a 503, so no client sees a connection cut mid-chunk.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rooflm.engine.admission import SLORejectedError
from rooflm.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream
from rooflm.outputs import RequestOutput
from rooflm.server.errors import OpenAIError, bad_request, error_body, from_value_error
from rooflm.server.metrics import ABORTED, ERROR, SUCCESS, RequestTracker, ServerMetrics
from rooflm.server.openai_prepare import _Prepared, _RequestPreparation
from rooflm.server.openai_render import _ResponseRendering
from rooflm.server.openai_sse import _DONE, _AbortingStreamingResponse, _sse
from rooflm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from rooflm.structured.tool_parsers import detect_tool_parser, get_tool_parser

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
_T = TypeVar("_T")


class _StreamCut(Exception):
    """The server is stopping: the stream ends with an error event."""


class OpenAIServing(_RequestPreparation, _ResponseRendering):
    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics, prep_workers: int = 2,
                 tool_call_parser: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.max_model_len = engine.max_model_len
        self._engine_tokenizer = engine.tokenizer
        self._local = threading.local()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, prep_workers),
                                                          thread_name_prefix="rooflm-prep")
        self.vocab_size = self._vocab_size()
        self.max_token_bytes = self._max_token_bytes()
        # The format tool calls are written in: forced (--tool-call-parser) or the model's own (its template / vocab).
        self.tool_parser = get_tool_parser(tool_call_parser or detect_tool_parser(self._engine_tokenizer))
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self._cut = asyncio.Event()
        self.stop_now = False  # set by the launcher on a forced stop: shutdown does not wait for the engine

    @property
    def tokenizer(self) -> Any:
        """This thread's copy of the tokenizer (the engine thread keeps the original for detokenization)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None and self._engine_tokenizer is not None:
            try:
                tok = copy.deepcopy(self._engine_tokenizer)
            except Exception:
                tok = self._engine_tokenizer
            self._local.tokenizer = tok
        return tok

    async def in_pool(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the preparation threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def cut_streams(self) -> None:
        """End every stream now with an error event and [DONE]; waiting non-streaming requests get a 503."""
        self._cut.set()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

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

    def _max_token_bytes(self) -> int | None:
        get_vocab = getattr(self._engine_tokenizer, "get_vocab", None)
        if get_vocab is None:
            return None
        try:
            pieces = get_vocab()
        except Exception:
            return None
        return max((len(str(piece).encode("utf-8")) for piece in pieces), default=0) or None

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
    async def _add_all(self, prep: _Prepared, response_id: str, arrival: float | None = None
                       ) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, (ids, params) in enumerate(zip(prep.prompts, prep.params)):
                streams.append(await self.engine.add_request(ids, params, request_id=f"{response_id}-{i}",
                                                             arrival_time=arrival))
        except BaseException as e:
            self._abort_all(streams)
            if isinstance(e, QueueFullError):
                raise OpenAIError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from None
            if isinstance(e, SLORejectedError):  # it would miss --ttft-slo-ms: answered now, not after a wait
                raise OpenAIError(503, str(e), code="ttft_slo_unattainable", headers={"Retry-After": "1"}) from None
            if isinstance(e, EngineDeadError):
                raise OpenAIError(503, f"the engine is not running: {e}", code="engine_unavailable") from None
            if isinstance(e, ValueError):
                if prep.structured_param and "StructuredOutputsParams" in str(e):  # the schema / regex / grammar
                    raise bad_request(str(e), param=prep.structured_param) from None
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
    async def create_completion(self, raw: bytes, request: Request, arrival: float | None = None) -> Response:
        """``arrival``: ``time.monotonic()`` when the request reached the server (default: now)."""
        arrival = arrival or time.monotonic()
        prep = await self.in_pool(lambda: self.prepare_completion(parse_body(CompletionRequest, raw)))
        return await self._generate(prep, request, chat=False, arrival=arrival)

    async def create_chat_completion(self, raw: bytes, request: Request, arrival: float | None = None) -> Response:
        arrival = arrival or time.monotonic()
        prep = await self.in_pool(lambda: self.prepare_chat(parse_body(ChatCompletionRequest, raw)))
        return await self._generate(prep, request, chat=True, arrival=arrival)

    async def _generate(self, prep: _Prepared, request: Request, chat: bool, arrival: float) -> Response:
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        tracker = self.metrics.tracker("chat_completions" if chat else "completions")
        streams = await self._add_all(prep, response_id, arrival)
        created = int(time.time())
        if prep.stream:
            gen = self._stream(prep, streams, tracker, response_id, created, chat, arrival)

            def on_close() -> None:
                self._abort_all(streams)
                tracker.finish(ABORTED)  # no-op when the stream already recorded its outcome

            return _AbortingStreamingResponse(gen, on_close, media_type="text/event-stream",
                                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        task = asyncio.ensure_future(self._collect(streams, tracker))
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            while True:
                done, _ = await asyncio.wait({task, cut}, timeout=_DISCONNECT_POLL_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    break
                if cut in done:
                    raise OpenAIError(503, "the server is shutting down; the request was not finished",
                                      code="server_shutdown")
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
        finally:
            cut.cancel()
        try:
            finals = task.result()
        except EngineDeadError as e:
            tracker.finish(ERROR)
            raise OpenAIError(503, f"the engine stopped while generating: {e}", code="engine_unavailable") from None
        tracker.finish(SUCCESS)
        render = self.chat_response if chat else self.completion_response
        return JSONResponse(await self.in_pool(render, prep, finals, response_id, created))

    async def _until_cut(self, merged: AsyncIterator[tuple[int, RequestOutput]]
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``merged``'s items until it ends, or until ``cut_streams()``: then raise ``_StreamCut``."""
        cut = asyncio.ensure_future(self._cut.wait())
        nxt: asyncio.Future | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(merged.__anext__())
                await asyncio.wait({nxt, cut}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    raise _StreamCut()
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            cut.cancel()
            if nxt is not None and not nxt.done():  # the caller closes ``merged`` next: it must not be running
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)

    def _first_token_sent(self, request_id: str, out: RequestOutput, arrival: float) -> None:
        """Report the delivery time of a first token (its engine stamp -> sent) to the engine's SLO admission."""
        stamped = out.metrics.first_token_time if out.metrics is not None else None
        if stamped is None:
            return
        now = time.monotonic()
        self.engine.observe_first_token_delivery(request_id, now - stamped)
        logger.debug("first token of %s sent: TTFT %.0f ms at the server (engine stamp at %.0f ms)", request_id,
                     (now - arrival) * 1e3, (stamped - arrival) * 1e3)

    async def _stream(self, prep: _Prepared, streams: list[RequestStream], tracker: RequestTracker, rid: str,
                      created: int, chat: bool, arrival: float) -> AsyncIterator[str]:
        """SSE body. Invariant: per choice, the concatenated deltas equal the non-streamed text, because the
        engine's cumulative text only grows and each delta is its new suffix. With echo, the prompt (and its
        logprobs) leads the first chunk of each choice."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent_text: dict[tuple[int, int], int] = {}  # (prompt, sample) → characters sent
        sent_tokens: dict[tuple[int, int], int] = {}  # → tokens whose logprobs were sent
        offsets: dict[tuple[int, int], int] = {}  # completions' text_offset so far
        done: set[tuple[int, int]] = set()
        finals: list[RequestOutput | None] = [None] * len(streams)
        tool_streams: dict[tuple[int, int], Any] = {}  # chat with tools: content and calls per choice

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
            async for i, out in self._until_cut(merged):
                tracker.on_output(out)
                finals[i] = out
                for o in out.outputs:
                    key = (i, o.index)
                    if key in done:
                        continue
                    first = key not in sent_text
                    if first and not o.token_ids and o.finish_reason is None:
                        continue  # prompt still being computed (its logprobs are not all there yet)
                    start = sent_text.get(key, 0)
                    delta = o.text[start:] if len(o.text) >= start else ""
                    if prep.echo and first:
                        delta = prep.prompt_texts[i] + delta
                    calls: list[dict[str, Any]] = []
                    if chat and prep.tool_names:
                        if key not in tool_streams:
                            tool_streams[key] = self.tool_parser.stream(prep.tool_names)
                        ts = tool_streams[key]
                        delta, calls = ts.feed(o.text, o.finish_reason is not None)
                    if not delta and not calls and o.finish_reason is None:
                        continue  # held back (partial character or possible stop string): wait for more
                    tok_start = sent_tokens.get(key, 0)
                    sent_text[key] = max(len(o.text), start)
                    sent_tokens[key] = len(o.token_ids)
                    index = i * prep.n + o.index
                    if chat:
                        finish = o.finish_reason
                        if key in tool_streams and tool_streams[key].calls and finish == "stop":
                            finish = "tool_calls"
                        choice: dict[str, Any] = {
                            "index": index, "delta": ({"content": delta} if delta else {}) | (
                                {"tool_calls": calls} if calls else {}),
                            "logprobs": None if prep.logprobs is None else self.chat_logprobs(
                                o, tok_start, prep.logprobs),
                            "finish_reason": finish}
                    else:
                        lp = self.completion_choice_logprobs(prep, out, i, o, tok_start, offsets.get(key, 0),
                                                             prep.echo and first)
                        if lp is not None:
                            offsets[key] = offsets.get(key, 0) + sum(len(t) for t in lp["tokens"])
                        choice = {"index": index, "text": delta, "logprobs": lp, "finish_reason": o.finish_reason}
                    if first and prep.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = self.vllm_prompt_logprobs(
                            self.prompt_entries(out, prep.prompts[i]), prep.prompt_logprobs)
                    if o.finish_reason is not None:
                        choice["stop_reason"] = o.stop_reason
                        done.add(key)
                    yield chunk(choice)
                    if first and o.token_ids and o.index == 0:  # sent: the stream resumes once it is written
                        self._first_token_sent(streams[i].request_id, out, arrival)
            if prep.include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                            "usage": self.usage(prep, finals)})
            yield _DONE
            tracker.finish(SUCCESS)
        except EngineDeadError as e:
            tracker.finish(ERROR)
            yield _sse(error_body(f"the engine stopped while generating: {e}", "service_unavailable_error",
                                  None, "engine_unavailable"))
            yield _DONE
        except _StreamCut:
            tracker.finish(ABORTED)
            yield _sse(error_body("the server is shutting down; the stream was cut before the end",
                                  "service_unavailable_error", None, "server_shutdown"))
            yield _DONE
        finally:
            await merged.aclose()  # aborts the engine requests still unfinished (client gone, or cut)
            tracker.finish(ABORTED)  # no-op unless the client left before the end

    # ------------------------------------------------------------------------------------------------ tokenizer
    async def tokenize(self, raw: bytes) -> dict[str, Any]:
        return await self.in_pool(lambda: self._tokenize(parse_body(TokenizeRequest, raw)))

    async def detokenize(self, raw: bytes) -> dict[str, Any]:
        return await self.in_pool(lambda: self._detokenize(parse_body(DetokenizeRequest, raw)))

    def _tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages must not be empty", param="messages")
            ids = self.render_chat(body.messages, body.add_generation_prompt is not False)
        else:
            ids = self._encode_checked(body.prompt, "prompt", add_special_tokens=body.add_special_tokens is not False)
        result: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}
        if body.return_token_strs:
            result["token_strs"] = list(self._require_tokenizer().convert_ids_to_tokens(ids))
        return result

    def _detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        self._check_ids(body.tokens, "tokens")
        return {"prompt": self._require_tokenizer().decode(body.tokens)}

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: what a client needs to tokenize and render chats as the server does."""
        tok = self._require_tokenizer()
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__, "model_max_length": self.max_model_len,
                                "vocab_size": self.vocab_size}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template", "padding_side",
                     "truncation_side", "add_bos_token", "add_eos_token", "clean_up_tokenization_spaces"):
            value = getattr(tok, name, None)
            if isinstance(value, (str, bool, int)):
                info[name] = value
        return info


def parse_body(model: type[_T], raw: bytes) -> _T:
    """Validate a JSON body against ``model``; errors become the same 400 as FastAPI's (see errors.py)."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    try:  # the standard parser, as FastAPI's: lone surrogates then reach validation, which names the field
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; RecursionError: nested too deep
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "input": None,
                                       "msg": f"{getattr(e, 'msg', e)}{where}"}]) from None
    try:
        return model.model_validate(data)  # type: ignore[attr-defined]
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None
