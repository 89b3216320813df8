"""Tool calling (OpenAI's ``tools`` / ``tool_choice``): the prompt, the grammar of a forced call, and parsing.

Rendering: a chat template that knows tools (it reads the ``tools`` variable, as transformers'
``apply_chat_template(tools=...)`` passes it) renders them itself. For a template without tool support the tools are
described in a system-message section (``fallback_tools_prompt``), in the Hermes / Qwen convention most instruction
models have seen: function signatures as JSON inside ``<tools></tools>``, and calls answered as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Earlier assistant calls and ``role: "tool"`` results in the history are rendered the same way (results as a user
turn inside ``<tool_response></tool_response>``). ``tool_choice="required"`` or a named function is enforced with a
grammar (``forced_call_grammar``): the output is exactly one such block whose arguments follow the function's
``parameters`` schema, so the call always parses and validates.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from rooflm.structured.backend import JSON_DEFAULTS

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template reads a ``tools`` variable (Jinja), i.e. renders tools itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" when tools are given
        return "tool_use" in template or any("tools" in str(t) for t in template.values())
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


HERMES_INSTRUCTIONS = ("To call a function, answer with a JSON object holding its name and arguments inside "
                       f"<tool_call></tool_call> tags:\n{CALL_OPEN}\n"
                       f'{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CALL_CLOSE}')


class CallFormat(Protocol):
    """How calls are written in a model's output (``rooflm.structured.tool_parsers`` has one per format)."""

    instructions: str  # the fallback prompt's sentence on how to call

    def format_calls(self, calls: list[tuple[str, Any]]) -> str: ...  # (name, arguments) → assistant text


def fallback_tools_prompt(tools: list[dict[str, Any]], instructions: str = HERMES_INSTRUCTIONS) -> str:
    """The system-message section that describes ``tools`` to a model whose template has no tool support."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou can call functions to help with the user's request. Their signatures, one JSON object "
            f"per line, are inside <tools></tools>:\n<tools>\n{lines}\n</tools>\n\n{instructions}")


def call_arguments(arguments: Any) -> Any:
    """Arguments as an object where they are JSON text (OpenAI sends them as text), else unchanged."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            pass
    return arguments


def hermes_calls(calls: list[tuple[str, Any]]) -> str:
    """``<tool_call>`` blocks, one per (name, arguments), one a line."""
    return "\n".join(f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': call_arguments(args)}, ensure_ascii=False)}"
                     f"\n{CALL_CLOSE}" for name, args in calls)


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      call_format: CallFormat | None = None) -> list[dict[str, Any]]:
    """Plain ``{"role", "content"}`` messages for a template without tool support: the tools' section joins the
    system message (or opens the conversation as one), assistant calls are written in ``call_format`` (default:
    ``<tool_call>`` blocks) and tool results become user turns inside ``<tool_response>``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            calls = call_format.format_calls(pairs) if call_format is not None else hermes_calls(pairs)
            content = "\n".join(([content] if content else []) + [calls])
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        section = fallback_tools_prompt(tools, call_format.instructions if call_format else HERMES_INSTRUCTIONS)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{section}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template with tool support: call arguments as objects (what such templates serialise)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                args = c["function"]["arguments"]
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass
                calls.append({"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": args}})
            m["tool_calls"] = calls
        out.append(m)
    return out


def call_schema(tools: list[dict[str, Any]], name: str | None = None, arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call object ``{"name": ..., arguments_key: {...}}`` to the function ``name`` or, when
    None, to any of ``tools``; the arguments follow the function's parameters schema."""
    options = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        options.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                          arguments_key: f.get("parameters") or _NO_PARAMETERS},
                        "required": ["name", arguments_key], "additionalProperties": False})
    if not options:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_DEFAULTS}


def forced_call_grammar(tools: list[dict[str, Any]], name: str | None = None) -> str:
    """A Lark grammar (llguidance's dialect, with an embedded JSON schema) for exactly one call block, to the
    function ``name`` or, when None, to any of ``tools``; the arguments follow the function's parameters schema."""
    schema = call_schema(tools, name)
    return (f"start: {json.dumps(CALL_OPEN + chr(10))} call {json.dumps(chr(10) + CALL_CLOSE)}\n"
            f"call: %json {json.dumps(schema)}\n")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, names: set[str] | frozenset[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls): every complete ``<tool_call>`` block whose JSON names one of ``names`` and carries object
    arguments is a call; the text outside those blocks is the content."""
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _parse_block(m.group(1), names)
        if call is None:
            continue
        content.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    content.append(text[pos:])
    return "".join(content), calls


def _parse_block(body: str, names: set[str] | frozenset[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


class ToolCallStream:
    """Streams one choice's content and tool calls as OpenAI ``delta``s from its growing text. Content streams until
    a ``<tool_call>`` may begin (a suffix that could open one is held back); each call goes out, whole, once its
    block closes; at the end the content outside the calls follows. The concatenated deltas equal what
    ``parse_tool_calls`` gives the non-streamed response."""

    def __init__(self, names: set[str] | frozenset[str]) -> None:
        self.names = names
        self.sent = 0  # characters of content sent
        self.calls: list[ToolCall] = []
        self.in_calls = False

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        delta = ""
        if not self.in_calls:
            at = text.find(CALL_OPEN, self.sent)
            if at >= 0:
                self.in_calls = True
                end = at
            elif finished:
                end = len(text)
            else:  # hold back a suffix that could be the start of "<tool_call>"
                end = len(text)
                for k in range(min(len(CALL_OPEN) - 1, len(text) - self.sent), 0, -1):
                    if CALL_OPEN.startswith(text[len(text) - k:]):
                        end = len(text) - k
                        break
            delta, self.sent = text[self.sent:end], max(self.sent, end)
        new_calls: list[dict[str, Any]] = []
        if self.in_calls:
            content, calls = parse_tool_calls(text, self.names)
            for c in calls[len(self.calls):]:
                new_calls.append({"index": len(self.calls), **c.to_openai()})
                self.calls.append(c)
            if finished:
                delta += content[self.sent:] if content.strip() else ""
                self.sent = len(content)
        return delta, new_calls
