"""Tool-call formats: how a model writes its calls, read back out of its output (whole or streamed), written into a
conversation's history, described to a model whose template has no tool support, and enforced by a grammar when a
call is forced (``tool_choice="required"`` or a named function). vLLM's ``--tool-call-parser`` names:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, anywhere in the message (Hermes,
  Qwen 2.5 / 3, SmolLM; ``rooflm.structured.tools``).
- ``llama3_json``: the whole message is the call, ``{"name": ..., "parameters": {...}}``, possibly after
  ``<|python_tag|>``; several calls are separated by ``;`` (Meta's Llama 3.1 / 3.2 / 3.3 JSON tool calling).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}`` (Mistral's v3 tokenizer
  format), or ``[TOOL_CALLS]name[ARGS]{...}`` once per call (v11 and later); text before the marker is content.
  Call ids are 9 alphanumeric characters, which Mistral's chat templates require of the ids sent back.

``detect_tool_parser`` picks one from the chat template, then from the vocabulary's special tokens; ``hermes`` when
neither tells (it is also the format the generic fallback prompt teaches).
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from rooflm.structured.tools import (
    CALL_OPEN,
    HERMES_INSTRUCTIONS,
    ToolCall,
    ToolCallStream,
    call_arguments,
    call_schema,
    forced_call_grammar,
    hermes_calls,
    new_call_id,
    parse_tool_calls,
)

_DECODER = json.JSONDecoder()


def _call(obj: Any, names: set[str] | frozenset[str], call_id: str, keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded object ``{"name": ..., <one of keys>: {...}}``; None unless the name is one of
    ``names`` and the arguments are an object (or JSON text of one)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    args = call_arguments(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), call_id)


def _objects(text: str, separators: str) -> list[Any] | None:
    """The JSON values that make up all of ``text``, separated by whitespace and ``separators``; None if any part is
    not JSON."""
    values, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


class ToolParser(ABC):
    """One call format. ``parse`` gives (content, calls) of a whole output; ``stream`` a streamer whose
    ``feed(text, finished)`` returns (content delta, new calls as OpenAI ``tool_calls`` deltas), the deltas adding
    up to what ``parse`` gives."""

    name: ClassVar[str]
    instructions: ClassVar[str]  # the fallback prompt's sentence on how to call
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens: keep them in the output text

    @abstractmethod
    def parse(self, text: str, names: set[str] | frozenset[str]) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output: calls to functions in ``names`` only."""

    def stream(self, names: set[str] | frozenset[str]) -> Any:
        return HeldCallStream(self, names)

    @abstractmethod
    def hold_from(self, text: str) -> int:
        """Where a call may begin in ``text``, still growing: content streams up to there (``len(text)``: none)."""

    @abstractmethod
    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        """An assistant message's calls, (name, arguments) each, written as the model writes them."""

    @abstractmethod
    def forced_call_grammar(self, tools: list[dict[str, Any]], name: str | None = None) -> str:
        """A grammar (llguidance's Lark) for exactly one call, to ``name`` or any of ``tools``, in this format."""


class HermesParser(ToolParser):
    name = "hermes"
    instructions = HERMES_INSTRUCTIONS

    def parse(self, text: str, names: set[str] | frozenset[str]) -> tuple[str, list[ToolCall]]:
        return parse_tool_calls(text, names)

    def stream(self, names: set[str] | frozenset[str]) -> ToolCallStream:
        return ToolCallStream(names)

    def hold_from(self, text: str) -> int:
        at = text.find(CALL_OPEN)
        return len(text) if at < 0 else at

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        return hermes_calls(calls)

    def forced_call_grammar(self, tools: list[dict[str, Any]], name: str | None = None) -> str:
        return forced_call_grammar(tools, name)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    instructions = ('To call a function, answer with only a JSON object holding its name and parameters, '
                    'nothing else:\n{"name": "<function name>", "parameters": {<arguments as JSON>}}')
    keeps_special_tokens = True

    def parse(self, text: str, names: set[str] | frozenset[str]) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(self.TAG)
        if not body.lstrip().startswith("{"):
            return text, []
        objects = _objects(body, ";")
        calls = [_call(o, names, new_call_id(), ("parameters", "arguments")) for o in objects or []]
        if not calls or None in calls:
            return text, []
        return "", calls  # type: ignore[return-value]

    def hold_from(self, text: str) -> int:
        start = len(text) - len(text.lstrip())
        rest = text[start:]
        if not rest or rest.startswith(("{", self.TAG)) or self.TAG.startswith(rest):
            return 0  # the whole message may be a call
        return len(text)

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": call_arguments(a)}, ensure_ascii=False)
                         for n, a in calls)

    def forced_call_grammar(self, tools: list[dict[str, Any]], name: str | None = None) -> str:
        return f"start: call\ncall: %json {json.dumps(call_schema(tools, name, 'parameters'))}\n"


def mistral_call_id() -> str:
    """Nine alphanumeric characters: what Mistral's chat templates accept as a tool call id."""
    return uuid.uuid4().hex[:9]


class MistralParser(ToolParser):
    name = "mistral"
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    instructions = ("To call functions, answer with [TOOL_CALLS] followed by a JSON array of calls, each holding a "
                    'function\'s name and arguments:\n[TOOL_CALLS] [{"name": "<function name>", '
                    '"arguments": {<arguments as JSON>}}]')
    keeps_special_tokens = True
    _NAMED = re.compile(r"\s*([A-Za-z0-9_-]{1,64})" + re.escape(ARGS))

    def parse(self, text: str, names: set[str] | frozenset[str]) -> tuple[str, list[ToolCall]]:
        at = text.find(self.MARK)
        if at < 0:  # the marker may have been dropped with the special tokens: a message that is only the array
            calls = self._array(text, names)
            return ("", calls) if calls else (text, [])
        calls = self._named(text[at:], names) if self.ARGS in text[at:] else self._array(text[at + len(self.MARK):],
                                                                                         names)
        return (text[:at], calls) if calls else (text, [])

    def _array(self, body: str, names: set[str] | frozenset[str]) -> list[ToolCall]:
        values = _objects(body, "")
        if not values or len(values) != 1:
            return []
        items = values[0] if isinstance(values[0], list) else [values[0]]
        calls = [_call(o, names, mistral_call_id(), ("arguments", "parameters")) for o in items]
        return [] if not calls or None in calls else calls  # type: ignore[return-value]

    def _named(self, body: str, names: set[str] | frozenset[str]) -> list[ToolCall]:
        calls = []
        for part in body.split(self.MARK)[1:]:
            m = self._NAMED.match(part)
            values = _objects(part[m.end():], "") if m else None
            if not m or not values or len(values) != 1:
                return []
            call = _call({"name": m.group(1), "arguments": values[0]}, names, mistral_call_id(), ("arguments",))
            if call is None:
                return []
            calls.append(call)
        return calls

    def hold_from(self, text: str) -> int:
        at = text.find(self.MARK)
        if at >= 0:
            return at
        if text.lstrip().startswith("["):  # the array without its marker (special tokens dropped)
            return 0
        for k in range(min(len(self.MARK) - 1, len(text)), 0, -1):  # a suffix that may open the marker
            if self.MARK.startswith(text[len(text) - k:]):
                return len(text) - k
        return len(text)

    def format_calls(self, calls: list[tuple[str, Any]]) -> str:
        items = [{"name": n, "arguments": call_arguments(a)} for n, a in calls]
        return f"{self.MARK} {json.dumps(items, ensure_ascii=False)}"

    def forced_call_grammar(self, tools: list[dict[str, Any]], name: str | None = None) -> str:
        # The bare array (no marker): the marker is a special token in Mistral's vocabularies, which a grammar over
        # text would spell out of ordinary tokens; ``parse`` reads a message that is only the array as calls.
        return f'start: "[" call "]"\ncall: %json {json.dumps(call_schema(tools, name))}\n'


class HeldCallStream:
    """Streams content until a call may begin (``parser.hold_from``), holds the rest, and at the end sends the calls
    ``parser.parse`` finds and the content it leaves that was not sent yet. Leading whitespace is held too (a
    message that turns out to be only calls has no content)."""

    def __init__(self, parser: ToolParser, names: set[str] | frozenset[str]) -> None:
        self.parser, self.names = parser, names
        self.sent = 0
        self.calls: list[ToolCall] = []

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        if not finished:
            end = max(self.sent, self.parser.hold_from(text))
            if not text[:end].strip():
                return "", []
            delta, self.sent = text[self.sent:end], end
            return delta, []
        content, calls = self.parser.parse(text, self.names)
        if calls and not content.strip():
            content = ""
        delta = content[self.sent:] if len(content) > self.sent else ""
        self.sent = max(self.sent, len(content))
        new = [{"index": i, **c.to_openai()} for i, c in enumerate(calls)]
        self.calls = calls
        return delta, new


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name`` (``--tool-call-parser``); ValueError naming the choices otherwise."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is not a known format: expected one of {', '.join(PARSERS)}")
    return PARSERS[name]()


def detect_tool_parser(tokenizer: Any) -> str:
    """The format the model writes calls in: from the markers its chat template writes, else from its vocabulary's
    special tokens; ``hermes`` when neither tells."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    template = template if isinstance(template, str) else ""
    for parser, markers in (("hermes", ("<tool_call>",)), ("mistral", ("[TOOL_CALLS]",)),
                            ("llama3_json", ("<|python_tag|>", '"parameters"'))):
        if any(m in template for m in markers):
            return parser
    try:
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    except Exception:  # noqa: BLE001 - a tokenizer without a usable vocabulary tells nothing
        vocab = {}
    for parser, token in (("mistral", "[TOOL_CALLS]"), ("llama3_json", "<|python_tag|>"), ("hermes", "<tool_call>")):
        if token in vocab:
            return parser
    return "hermes"
