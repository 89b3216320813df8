"""``StructuredOutputsParams``: which constraint a request's output must follow (vLLM's field names).

Exactly one of ``json`` (a JSON schema, as a dict or a JSON string), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of a list of strings) or ``grammar`` (a Lark grammar, or GBNF / EBNF, as llguidance accepts) is set.
The shape is checked here; whether a schema, regex or grammar compiles is checked by the grammar backend when the
engine receives the request (``StructuredOutputManager.compile``), with the same kind of ValueError.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _fail(name: str, value: object, accepted: str) -> None:
    raise ValueError(f"StructuredOutputsParams.{name}={value!r:.200} is invalid: expected {accepted}")


@dataclass
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as e:
                    _fail("json", self.json, f"a JSON schema (an object, or its JSON text): {e}")
                self.json = parsed
            if not isinstance(self.json, (dict, bool)):
                _fail("json", self.json, "a JSON schema: an object (or its JSON text)")
        if self.json_object is not None and self.json_object is not True:
            _fail("json_object", self.json_object, "True or None")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            _fail("regex", self.regex, "a non-empty regular expression")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                _fail("choice", self.choice, "a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            _fail("grammar", self.grammar, "a non-empty Lark or GBNF grammar")
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    def key(self) -> tuple[str, str]:
        """A hashable key of the constraint: (kind, canonical text). Equal keys compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "choice"):
            return kind, json.dumps(value, sort_keys=True, separators=(",", ":"))
        return kind, str(value)

    @classmethod
    def from_any(cls, value: "StructuredOutputsParams | dict[str, Any] | None") -> "StructuredOutputsParams | None":
        """None, an instance, or a dict of its fields (unknown keys are a ValueError naming them)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"SamplingParams.structured_outputs={value!r:.200} is invalid: expected a "
                             "StructuredOutputsParams or a dict with one of " + ", ".join(KINDS))
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"SamplingParams.structured_outputs has unknown field(s) {unknown}: expected one of "
                             + ", ".join(KINDS))
        return cls(**value)
