"""Request preparation for the OpenAI generation endpoints: validation that pydantic cannot do (model name,
token ids within the vocabulary, context length, unsupported options), tokenization / chat-template rendering,
and the per-prompt SamplingParams, gathered into a ``_Prepared`` ready for the engine.

``_RequestPreparation`` is a mixin of ``OpenAIServing``: it reads ``engine``, ``model_name``, ``tokenizer``,
``vocab_size`` and ``max_model_len`` from the instance."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from rooflm.engine.async_engine import AsyncLLMEngine
from rooflm.sampling_params import SamplingParams
from rooflm.server.errors import OpenAIError, bad_request, from_value_error
from rooflm.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from rooflm.structured import tools as tool_calls
from rooflm.structured.params import StructuredOutputsParams
from rooflm.structured.tool_parsers import ToolParser


@dataclass
class _Prepared:
    """A validated generation request, ready for the engine."""

    prompts: list[list[int]]  # token ids, one engine request each
    prompt_texts: list[str]  # for echo
    params: list[SamplingParams]  # per prompt (max_tokens depends on the prompt's length)
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-k to report; None: no logprobs
    echo: bool = False
    prompt_param: str = "prompt"  # the field an engine-side ValueError about the prompt names
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field: top-k per prompt position to report
    echo_only: bool = False  # max_tokens=0 with echo: one token is generated (the engine needs one) and dropped
    structured_param: str | None = None  # the field that set the constraint (an engine ValueError names it)
    tool_names: frozenset[str] | None = None  # functions whose calls are parsed out of the output; None: no tools


class _RequestPreparation:
    """Validation, tokenization and SamplingParams building; mixed into ``OpenAIServing``."""

    engine: AsyncLLMEngine
    model_name: str
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    max_token_bytes: int | None  # the longest vocabulary entry in UTF-8 bytes (None: unknown)
    tool_parser: ToolParser  # the format of tool calls in the model's output

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                              param="model", code="model_not_found")

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise bad_request("the served model has no tokenizer: send token ids", param="prompt")
        return self.tokenizer

    # ------------------------------------------------------------------------------------------------ validation
    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of the vocabulary (ids are in [0, {self.vocab_size}))",
                              param=param)

    def _max_tokens(self, prompt_len: int, requested: int | None, default: int | None, prompt_param: str,
                    tokens_param: str) -> int:
        """Resolve max_tokens so that prompt + output fits ``max_model_len``; 400 stating the limit otherwise."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt has {prompt_len} tokens: "
                f"shorten it to at most {limit - 1} tokens.", param=prompt_param, code="context_length_exceeded")
        room = limit - prompt_len
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len} tokens and "
                f"{tokens_param}={requested} asks for {requested} more ({prompt_len + requested} > {limit}): "
                f"ask for at most {room}.", param=tokens_param, code="context_length_exceeded")
        return requested

    def _encode_checked(self, text: str, param: str, **kw: Any) -> list[int]:
        """Tokenize ``text``, refusing at once (without tokenizing) a text whose UTF-8 length alone proves it is
        over the context: no token covers more than ``max_token_bytes`` bytes, and Unicode normalisation shrinks a
        text at most about threefold, so ``bytes / (4 * max_token_bytes)`` is a safe lower bound on its tokens."""
        if self.max_token_bytes and len(text) >= self.max_model_len:
            size = len(text.encode("utf-8"))
            at_least = size // (4 * self.max_token_bytes)
            if at_least >= self.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {self.max_model_len} tokens, but the text has {size} "
                    f"bytes, at least {at_least} tokens: shorten it.", param=param, code="context_length_exceeded")
        return list(self._require_tokenizer().encode(text, **kw))

    def _logit_bias(self, body: SamplingRequest) -> dict[int, float] | None:
        if not body.logit_bias:
            return None
        bias: dict[int, float] = {}
        for key, value in body.logit_bias.items():
            if not key.isdigit() or len(key) > 10 or int(key) >= self.vocab_size:
                raise bad_request(f"logit_bias key {key!r} is not a token id in [0, {self.vocab_size})",
                                  param="logit_bias")
            bias[int(key)] = value
        return bias

    def _common_checks(self, body: SamplingRequest) -> int:
        self.check_model(body.model)
        n = body.n or 1
        if n > self.engine.max_num_seqs:
            raise bad_request(f"n={n} exceeds the {self.engine.max_num_seqs} sequences the server runs at once",
                              param="n")
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if body.store:
            raise bad_request("store=true is not supported: this server keeps no completions", param="store")
        return n

    def _sampling_params(self, body: SamplingRequest, n: int, max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         structured: StructuredOutputsParams | None = None) -> SamplingParams:
        top_k = body.top_k or 0
        if top_k >= self.vocab_size:  # the whole vocabulary: the same as no top-k
            top_k = 0
        try:
            return SamplingParams(
                n=n,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                min_p=body.min_p or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                seed=body.seed,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens or 0,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=bool(body.ignore_eos),
                include_stop_str_in_output=bool(body.include_stop_str_in_output),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=body.skip_special_tokens is not False,
                logit_bias=self._logit_bias(body),
                priority=body.priority or 0,
                user=body.user,
                structured_outputs=structured,
            )
        except ValueError as e:
            raise from_value_error(e, None) from None

    def prepare_completion(self, body: CompletionRequest) -> _Prepared:
        n = self._common_checks(body)
        if body.best_of is not None and body.best_of != n:
            raise bad_request(f"best_of={body.best_of} is not supported: only best_of == n ({n})", param="best_of")
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        echo_only = body.max_tokens == 0
        if echo_only and not body.echo:
            raise bad_request("max_tokens=0 is only allowed with echo=true (to score the prompt)", param="max_tokens")
        if echo_only and body.stream:
            raise bad_request("max_tokens=0 is not supported with stream=true", param="max_tokens")
        # The engine computes prompt logprobs once, with the larger k; each field reports its own top-k.
        wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
        engine_prompt_k = max(wanted) if wanted else None
        structured, structured_param = self._output_constraint(body)
        if structured is not None and echo_only:
            raise bad_request(f"{structured_param} is not supported with max_tokens=0", param=structured_param)
        raw = body.prompt
        items: list[str | list[int]]
        if isinstance(raw, str):
            items = [raw]
        elif raw and isinstance(raw[0], int):
            items = [list(raw)]  # type: ignore[arg-type]
        else:
            items = list(raw)  # type: ignore[arg-type]
        prompts, texts, params = [], [], []
        for item in items:
            if isinstance(item, str):
                ids = self._encode_checked(item, "prompt")
                text = item
            else:
                self._check_ids(item, "prompt")
                ids = list(item)
                text = self.tokenizer.decode(ids) if (body.echo and self.tokenizer is not None) else ""
            if not ids:
                raise bad_request("the prompt is empty after tokenization", param="prompt")
            requested = 1 if echo_only else body.max_tokens
            max_tokens = self._max_tokens(len(ids), requested, 16, "prompt", "max_tokens")
            params.append(self._sampling_params(body, n, max_tokens, body.logprobs, engine_prompt_k, structured))
            prompts.append(ids)
            texts.append(text)
        return _Prepared(prompts, texts, params, n, bool(body.stream),
                         bool(body.stream_options and body.stream_options.include_usage), body.logprobs,
                         echo=bool(body.echo), prompt_logprobs=body.prompt_logprobs, echo_only=echo_only,
                         structured_param=structured_param if structured else None)

    def render_chat(self, messages: list[Any], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the conversation through the model's chat template; tools (and tool calls / results in the
        history) through the template when it supports them, else through the generic fallback
        (``rooflm.structured.tools``)."""
        tok = self._require_tokenizer()
        plain = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            plain.append(d)
        kw: dict[str, Any] = {}
        uses_tools = bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages)
        if uses_tools and tool_calls.template_supports_tools(tok):
            plain = tool_calls.template_messages(plain)
            if tools:
                kw["tools"] = tools
        elif uses_tools:
            plain = tool_calls.fallback_messages(plain, tools, self.tool_parser)
        try:
            text = tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
        except Exception as e:  # jinja errors: the template refuses this conversation
            raise bad_request(f"the model's chat template cannot render these messages: {e}", param="messages")
        if not isinstance(text, str):
            raise bad_request("the model's chat template did not produce text", param="messages")
        return self._encode_checked(text, "messages", add_special_tokens=False)

    @staticmethod
    def _structured_field(body: SamplingRequest) -> StructuredOutputsParams | None:
        if body.structured_outputs is None:
            return None
        fields = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        try:
            return StructuredOutputsParams(**fields)
        except ValueError as e:
            raise bad_request(str(e), param="structured_outputs") from None

    @classmethod
    def _output_constraint(cls, body: SamplingRequest) -> tuple[StructuredOutputsParams | None, str]:
        """(constraint, the field that set it) from ``structured_outputs`` or ``response_format`` (both endpoints)."""
        structured, param = cls._structured_field(body), "structured_outputs"
        fmt = body.response_format
        if fmt is not None and fmt.type != "text":
            if structured is not None:
                raise bad_request("send one of response_format and structured_outputs", param="response_format")
            param = "response_format"
            if fmt.type == "json_object":
                structured = StructuredOutputsParams(json_object=True)
            elif fmt.json_schema is None:
                raise bad_request("response_format of type json_schema needs a json_schema object",
                                  param="response_format")
            elif fmt.json_schema.schema_ is None:
                structured = StructuredOutputsParams(json_object=True)
            else:
                structured = StructuredOutputsParams(json=fmt.json_schema.schema_)
        return structured, param

    def _chat_constraints(self, body: ChatCompletionRequest):
        """(constraint, the field that set it, tools to render, names of the functions to parse calls of)."""
        structured, param = self._output_constraint(body)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = body.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if not tools:
            if choice not in ("none", "auto"):
                raise bad_request(f"tool_choice={choice!r} needs tools", param="tool_choice")
            return structured, param, None, None
        if choice == "none":
            return structured, param, None, None
        names = frozenset(t["function"]["name"] for t in tools)
        if len(names) != len(tools):
            raise bad_request("tools has two functions with the same name", param="tools")
        if choice == "auto":
            return structured, param, tools, names
        if structured is not None:
            raise bad_request(f"tool_choice={choice!r} cannot be combined with {param}: the call's format is fixed",
                              param="tool_choice")
        name = None if choice == "required" else choice.function.name
        if name is not None and name not in names:
            raise bad_request(f"tool_choice names function {name!r}, which is not among the tools",
                              param="tool_choice")
        grammar = self.tool_parser.forced_call_grammar(tools, name)
        return StructuredOutputsParams(grammar=grammar), "tools", tools, names

    def prepare_chat(self, body: ChatCompletionRequest) -> _Prepared:
        n = self._common_checks(body)
        structured, structured_param, tools, tool_names = self._chat_constraints(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        ids = self.render_chat(body.messages, body.add_generation_prompt is not False, tools)
        if not ids:
            raise bad_request("the messages render to an empty prompt", param="messages")
        requested, param = body.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, param = body.max_tokens, "max_tokens"
        if requested == 0:
            raise bad_request(f"{param}=0 is invalid for chat completions: expected an integer >= 1", param=param)
        max_tokens = self._max_tokens(len(ids), requested, None, "messages", param)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, n, max_tokens, logprobs, body.prompt_logprobs, structured)
        if tool_names and self.tool_parser.keeps_special_tokens and "skip_special_tokens" not in body.model_fields_set:
            params = dataclasses.replace(params, skip_special_tokens=False)  # the call markers are special tokens
        return _Prepared([ids], [""], [params], n, bool(body.stream),
                         bool(body.stream_options and body.stream_options.include_usage), logprobs,
                         prompt_param="messages", prompt_logprobs=body.prompt_logprobs,
                         structured_param=structured_param if structured else None, tool_names=tool_names)
