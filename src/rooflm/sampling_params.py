"""Per-request sampling options, with vLLM's names where they exist.

Every field is validated in ``__post_init__``; a bad value raises ``ValueError`` whose message names the field,
the value seen and what would be accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _fail(name: str, value: object, accepted: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {accepted}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the chosen token always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            _fail("n", self.n, "an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            _fail("temperature", self.temperature, "a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "a number in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            _fail("top_k", self.top_k, "an integer >= 0 (0 or -1 disables it)")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "a number in [0, 1]")
        if not isinstance(self.repetition_penalty, (int, float)) or self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "a number > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2 <= v <= 2:
                _fail(name, v, "a number in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            _fail("seed", self.seed, "an integer or None")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            _fail("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"at most max_tokens={self.max_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 20):
                _fail(name, v, "None or an integer in [0, 20]")

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temperature 0 (top_k=1 gives the same tokens through the sampling path)."""
        return self.temperature == 0

    def clone(self, **changes: object) -> "SamplingParams":
        from dataclasses import replace

        return replace(self, **changes)
