"""Per-request sampling options, with vLLM's names where they exist.

Every field is validated in ``__post_init__``; a bad value raises ``ValueError`` whose message names the field,
the value seen and what would be accepted, e.g. ``SamplingParams.top_p=0 is invalid: expected a number in (0, 1]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rooflm.kv_cache.compression import KVCompressionConfig

from rooflm.structured.params import StructuredOutputsParams

# A temperature below this is treated as greedy (dividing logits by it would overflow float32).
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range of logit_bias values


def _fail(name: str, value: object, accepted: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {accepted}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    """A finite int or float (bools are not numbers here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled (-1 is normalised to 0)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the chosen token always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # {token_id: bias} added to the logits before penalties and sampling (OpenAI's logit_bias); the reported
    # logprobs stay those of the model. Normalised to a dict of int -> float.
    logit_bias: dict[int, float] | None = None
    # Scheduling (not sampling), kept here so they travel with the request through every front door:
    # ``priority`` orders admission under the "priority" policy (lower first, vLLM's semantics); ``user`` names the
    # client the "fair" policy accounts service to (OpenAI's ``user`` field).
    priority: int = 0
    user: str | None = None
    # Constrained decoding (vLLM's name): a JSON schema, any JSON object, a regex, a choice or a grammar. A dict of
    # StructuredOutputsParams' fields is accepted and converted.
    structured_outputs: StructuredOutputsParams | None = None
    # Lossy KV compression for this request, overriding the engine's (rooflm.kv_cache.compression): a dict such as
    # {"method": "streaming", "budget": 512, "sink": 4}, normalised to a KVCompressionConfig; None: the engine's.
    kv_compression: KVCompressionConfig | dict | None = None

    def __post_init__(self) -> None:
        # Container types are checked before normalising, so a bad type is a ValueError, not a TypeError.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            _fail("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            _fail("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", self.logit_bias, f"None or a dict of token id -> bias in [{-MAX_LOGIT_BIAS:g}, "
                      f"{MAX_LOGIT_BIAS:g}]")
            self.logit_bias = dict(self.logit_bias) or None
        self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
        if self.kv_compression is not None:
            from rooflm.kv_cache.compression import KVCompressionConfig

            self.kv_compression = KVCompressionConfig.parse(self.kv_compression)
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            _fail("n", self.n, "an integer >= 1")
        if not _is_real(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("top_k", self.top_k, "an integer >= 1, or 0 or -1 to disable it")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "a number in [0, 1]")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2 <= v <= 2:
                _fail(name, v, "a number in [-2, 2]")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", self.seed, "an integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"at most max_tokens={self.max_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                _fail(name, v, f"None or an integer in [0, {MAX_LOGPROBS}]")
        for tid, bias in (self.logit_bias or {}).items():
            if not _is_int(tid) or tid < 0 or not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                _fail("logit_bias", {tid: bias}, f"token ids >= 0 mapped to biases in [{-MAX_LOGIT_BIAS:g}, "
                      f"{MAX_LOGIT_BIAS:g}]")
        if not _is_int(self.priority):
            _fail("priority", self.priority, "an integer (lower is served first)")
        if self.user is not None and not isinstance(self.user, str):
            _fail("user", self.user, "None or a string naming the client")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                _fail(name, v, "True or False")
        if self.ignore_eos and self.structured_outputs is not None:
            # A finished grammar allows only EOS: ignoring it would leave no valid token to sample.
            _fail("ignore_eos", True, "False with structured_outputs (the output ends when the grammar does)")

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temperature 0 (below SAMPLING_EPS). top_k=1 gives the same tokens."""
        return self.temperature < SAMPLING_EPS

    def clone(self, **changes: object) -> "SamplingParams":
        return replace(self, **changes)
