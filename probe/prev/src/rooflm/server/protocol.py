"""Request bodies of the OpenAI-compatible API, as pydantic models.

Validation is strict (``"1"`` is not an integer, ``true`` is not a number) and rejects NaN/Infinity, so every value
that reaches ``SamplingParams`` and the engine has the type and range the engine expects; anything else becomes a
400 naming the field (see ``errors.py``). Nothing is silently ignored: an unknown field is a 400 naming it, and
the only accepted fields without an effect are the bookkeeping ones in ``NO_OP_FIELDS`` (listed in
docs/serving.md). Ranges follow the OpenAI reference; the extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``prompt_logprobs``, ...) use vLLM's names.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP = 16  # stop strings per request
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # top-k logprobs per position (vLLM's default limit)
# Accepted and without effect on the output: bookkeeping fields of the OpenAI API. (``user`` names the client the
# "fair" scheduling policy accounts service to: it changes when tokens come, never which.)
NO_OP_FIELDS = ("user", "metadata", "store", "service_tier")


def _valid_unicode(text: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer or UTF-8 response can hold: refuse them here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds {text[e.start:e.end]!r} at position {e.start}, a lone surrogate: "
                         "not valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyStr = Annotated[Text, StringConstraints(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` extension: exactly one constraint (checked by ``StructuredOutputsParams``)."""

    json_: dict[Text, Any] | Text | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: Annotated[list[Text], Field(max_length=1024)] | None = None
    grammar: Text | None = None


class JsonSchemaFormat(_Strict):
    name: Annotated[Text, StringConstraints(max_length=64)]
    description: Text | None = None
    schema_: dict[Text, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the output always follows the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo (completions)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=0.0, ge=-2, le=2)
    logit_bias: Annotated[dict[Text, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=1024)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # no-op bookkeeping fields (NO_OP_FIELDS)
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    # extras, vLLM's names
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=0, ge=0)
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=MAX_STOP)] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    priority: int | None = Field(default=0, ge=-(2**31), lt=2**31)  # vLLM's extra: lower is served first
    structured_outputs: StructuredOutputsField | None = None  # vLLM's extra: constrained decoding
    response_format: ResponseFormat | None = None  # OpenAI's (chat); on completions too, as vLLM accepts it


class CompletionRequest(SamplingRequest):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)  # only best_of == n is supported
    suffix: Text | None = None  # only empty / null is supported


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCallMessage(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=256)] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCallMessage], Field(min_length=1, max_length=128)] | None = None  # assistant
    tool_call_id: Text | None = None  # tool

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[Text, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None  # calls are always schema-valid when enforced (tool_choice required / named)


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = True  # extra: vLLM's name
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # a forced call is always one call; "auto" parses all the model makes


class TokenizeRequest(_Strict):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False  # vLLM's extra: the token strings too


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]
