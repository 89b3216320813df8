"""The llguidance backend (Microsoft's guidance grammar engine, in Rust): grammars compiled from the constraint of a
request, and matchers that give the tokens allowed next.

llguidance is an optional dependency (``pip install 'rooflm[structured]'``), imported here only, and only when a
request asks for structured output. It computes a token mask from the tokenizer's byte strings and an Earley parser
over a lexer, so a mask costs tens of microseconds for typical JSON schemas on the CPU, without torch.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from rooflm.structured.params import StructuredOutputsParams

# A JSON object with any content (OpenAI's response_format {"type": "json_object"}).
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# JSON is generated in json.dumps' layout (", " and ": ", no other whitespace): a small model allowed free whitespace
# can spend its whole token budget on newlines. A schema may choose otherwise with llguidance's "x-guidance" key
# (e.g. {"x-guidance": {"whitespace_flexible": true}}), which takes precedence over these defaults.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:
        raise ValueError("structured_outputs needs the llguidance package: pip install 'rooflm[structured]'") from e
    return llguidance


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``spec`` (not yet checked: ``LLGuidanceBackend.compile`` checks it)."""
    llg = import_llguidance()
    kind = spec.kind
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(spec.json), defaults=JSON_DEFAULTS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(ANY_OBJECT_SCHEMA), defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:
        return llg.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"StructuredOutputsParams.grammar is invalid: {e}") from None


def _hf_tokenizer_json(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured_outputs needs a fast (Rust-backed) Hugging Face tokenizer; this model's "
                         f"tokenizer is {type(tokenizer).__name__}")
    from copy import copy

    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class LLGuidanceBackend:
    """Owns the llguidance tokenizer of one model and an LRU cache of compiled grammars: a pristine matcher per
    constraint, which each request copies (``deep_copy`` shares the compiled grammar, so the ``n`` samples of a
    request and repeated schemas compile once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256) -> None:
        llg = import_llguidance()
        self.llg = llg
        self.vocab_size = vocab_size
        # n_vocab = the model's logits width, so mask bits line up with logit columns.
        try:
            self.tokenizer = llg.LLTokenizer(_hf_tokenizer_json(tokenizer), n_vocab=vocab_size,
                                             eos_token=list(eos_token_ids) or None)
        except Exception as e:  # e.g. a tokenizer with more entries than the model has logits
            raise ValueError(f"structured_outputs: llguidance cannot use this model's tokenizer "
                             f"({type(tokenizer).__name__}, vocab_size={vocab_size}): {e}") from None
        self.cache_size = cache_size
        self.executor: Any = None  # llguidance's thread pool for the masks of a batch, made on first use
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The pristine matcher of ``spec`` (do not advance it: ``matcher`` copies it), from the cache when this
        constraint was seen lately. A schema, regex or grammar that llguidance refuses raises ValueError naming the
        field and llguidance's reason."""
        key = spec.key()
        pristine = self._cache.get(key)
        if pristine is not None:
            self._cache.move_to_end(key)
            return pristine
        try:
            grammar = grammar_text(spec)
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.{spec.kind} is invalid: {e}") from None
        pristine = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if pristine.is_error():
            raise ValueError(f"StructuredOutputsParams.{spec.kind}={getattr(spec, spec.kind)!r:.200} is invalid: "
                             f"{pristine.get_error().strip()}")
        self._cache[key] = pristine
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return pristine

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh ``llguidance.LLMatcher`` at the start of ``spec``'s grammar."""
        return self.compile(spec).deep_copy()

    def fill_masks(self, matchers: Sequence[tuple[Any, int]], bitmask: Any) -> None:
        """Write the allowed-token mask of each (matcher, row) into the rows of ``bitmask`` (a C-contiguous
        [rows, bitmask_words] int32 host tensor). Several matchers are computed in parallel on llguidance's threads."""
        row_bytes = self.bitmask_words * 4
        if len(matchers) == 1:
            m, row = matchers[0]
            m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)
        elif matchers:
            if self.executor is None:
                self.executor = self.llg.LLExecutor()
            self.executor.unsafe_compute_mask_ptr(list(matchers), bitmask.data_ptr(), row_bytes, bitmask.shape[0])

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32
