"""Workloads for the serving benchmark, drawn from public-domain text shipped with rooflm.

Prompts are windows of consecutive words of a text (by default chapters 1-12 of Jane Austen's *Pride and
Prejudice*, 1813, in ``bench/data/``), sized to a target number of tokens with a tokens-per-word ratio (measured
against the server's tokenizer when it offers ``/tokenize``, 1.3 otherwise; the token counts reported come from the
server's ``usage``).

Length distributions:

- ``sharegpt-like`` (default): prompt and output lengths are independent, clipped log-normal draws,
  ``L = clip(round(exp(N(mu, sigma^2))), lo, hi)``. The ShareGPT sample used in the vLLM paper averages about
  200 prompt and 180 output tokens with long right tails; we use ``sigma = 1.0`` for prompts and ``0.8`` for
  outputs, clip both to ``[4, 1024]`` and choose ``mu`` (by bisection on the closed-form mean of the clipped
  log-normal) so that the mean *after* clipping is exactly the target mean (200 / 180 by default). The medians are
  then about 127 and 132 tokens: most requests are short, a few are long, like real chat traffic.
- ``fixed``: every request has the same prompt and output length (``--input-len`` / ``--output-len``).
- ``heavy-tailed``, ``multi-client`` and ``priority``: the scheduling workloads, described below.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from importlib import resources

DEFAULT_TEXT = "austen_pride_and_prejudice.txt"
DEFAULT_TOKENS_PER_WORD = 1.3  # English prose with a BPE tokenizer of ~50k entries

# ShareGPT-like defaults (see the module docstring).
SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT = 200, 180
SHAREGPT_SIGMA_INPUT, SHAREGPT_SIGMA_OUTPUT = 1.0, 0.8
MIN_LEN, MAX_LEN = 4, 1024


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # target length in tokens (the server's usage gives the exact count)
    output_len: int  # max_tokens to ask for
    user: str | None = None  # the client (sent as the OpenAI ``user`` field)
    priority: int | None = None  # sent as the ``priority`` field (vLLM's extra: lower is served first)


def load_text(path: str | None = None) -> str:
    """The text to draw prompts from: a file, or the excerpt shipped with rooflm."""
    if path is not None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    else:
        text = (resources.files("rooflm.bench") / "data" / DEFAULT_TEXT).read_text(encoding="utf-8")
    if len(text.split()) < 16:
        raise ValueError(f"dataset text {path or DEFAULT_TEXT!r} has fewer than 16 words")
    return text


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for ln X ~ N(mu, sigma^2)."""
    a = (math.log(lo) - mu) / sigma
    b = (math.log(hi) - mu) / sigma
    inside = math.exp(mu + sigma * sigma / 2) * (_phi(b - sigma) - _phi(a - sigma))
    return lo * _phi(a) + hi * (1.0 - _phi(b)) + inside


def lognormal_mu_for_mean(mean: float, sigma: float, lo: float, hi: float) -> float:
    """The mu whose clipped log-normal has the given mean (lo < mean < hi)."""
    if not lo < mean < hi:
        raise ValueError(f"mean={mean} is invalid: expected a value strictly between {lo} and {hi}")
    low, high = math.log(lo) - 10 * sigma, math.log(hi) + 10 * sigma  # E is increasing in mu
    for _ in range(200):
        mid = (low + high) / 2
        if clipped_lognormal_mean(mid, sigma, lo, hi) < mean:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def sample_lengths(rng: random.Random, count: int, mean: float, sigma: float, lo: int = MIN_LEN,
                   hi: int = MAX_LEN) -> list[int]:
    if sigma <= 0:
        return [int(min(max(round(mean), lo), hi))] * count
    mu = lognormal_mu_for_mean(mean, sigma, lo, hi)
    return [int(min(max(round(rng.lognormvariate(mu, sigma)), lo), hi)) for _ in range(count)]


class TextWindows:
    """Prompts of about N tokens: windows of consecutive words at random offsets of the text."""

    def __init__(self, text: str, tokens_per_word: float = DEFAULT_TOKENS_PER_WORD) -> None:
        if tokens_per_word <= 0:
            raise ValueError(f"tokens_per_word={tokens_per_word} is invalid: expected a number > 0")
        self.words = text.split()
        self.tokens_per_word = tokens_per_word

    def prompt(self, rng: random.Random, num_tokens: int) -> str:
        k = max(1, round(num_tokens / self.tokens_per_word))
        words = self.words
        while len(words) <= k:  # a long prompt from a short text: wrap around
            words = words + self.words
        start = rng.randrange(len(words) - k)
        return " ".join(words[start:start + k])


def sharegpt_like(num_prompts: int, windows: TextWindows, seed: int = 0,
                  mean_input_len: float = SHAREGPT_MEAN_INPUT, mean_output_len: float = SHAREGPT_MEAN_OUTPUT,
                  sigma_input: float = SHAREGPT_SIGMA_INPUT, sigma_output: float = SHAREGPT_SIGMA_OUTPUT,
                  max_input_len: int = MAX_LEN, max_output_len: int = MAX_LEN) -> list[SampleRequest]:
    rng = random.Random(seed)
    ins = sample_lengths(rng, num_prompts, mean_input_len, sigma_input, MIN_LEN, max_input_len)
    outs = sample_lengths(rng, num_prompts, mean_output_len, sigma_output, MIN_LEN, max_output_len)
    return [SampleRequest(windows.prompt(rng, i), i, o) for i, o in zip(ins, outs)]


def fixed_lengths(num_prompts: int, windows: TextWindows, input_len: int, output_len: int,
                  seed: int = 0) -> list[SampleRequest]:
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len={input_len}, output_len={output_len}: both must be >= 1")
    rng = random.Random(seed)
    return [SampleRequest(windows.prompt(rng, input_len), input_len, output_len) for _ in range(num_prompts)]


# Scheduling workloads (docs/scheduling.md) -------------------------------------------------------------------------
# ``heavy-tailed``: output lengths from a Pareto law, L = clip(round(x_m * U^(-1/alpha)), x_m, hi) with U uniform on
# (0, 1]: most requests are short, a few are very long (alpha near 1: the long ones hold most of the tokens), the
# workload where size-based scheduling (FastServe's MLFQ) shortens the mean completion time most. Prompts are
# clipped log-normal as in ``sharegpt-like``.
HEAVY_TAIL_MIN_OUTPUT, HEAVY_TAIL_ALPHA = 8, 1.1
# ``multi-client``: one heavy client sending most of the requests, ahead of several light ones (Sheng et al. 2024's
# setting for the Virtual Token Counter); each request carries its client as the OpenAI ``user`` field.
HEAVY_CLIENT, LIGHT_CLIENT = "heavy", "light"


def pareto_lengths(rng: random.Random, count: int, x_min: int, alpha: float, hi: int) -> list[int]:
    if x_min < 1 or hi < x_min or not alpha > 0:
        raise ValueError(f"pareto lengths: x_min={x_min}, alpha={alpha}, hi={hi}: expected 1 <= x_min <= hi and "
                         "alpha > 0")
    return [int(min(hi, round(x_min * (1.0 - rng.random()) ** (-1.0 / alpha)))) for _ in range(count)]


def heavy_tailed(num_prompts: int, windows: TextWindows, seed: int = 0, mean_input_len: float = 64,
                 sigma_input: float = 0.5, max_input_len: int = 256, min_output_len: int = HEAVY_TAIL_MIN_OUTPUT,
                 alpha: float = HEAVY_TAIL_ALPHA, max_output_len: int = 512) -> list[SampleRequest]:
    rng = random.Random(seed)
    ins = sample_lengths(rng, num_prompts, mean_input_len, sigma_input, MIN_LEN, max_input_len)
    outs = pareto_lengths(rng, num_prompts, min_output_len, alpha, max_output_len)
    return [SampleRequest(windows.prompt(rng, i), i, o) for i, o in zip(ins, outs)]


def multi_client(num_prompts: int, windows: TextWindows, seed: int = 0, num_light: int = 3,
                 heavy_fraction: float = 0.6, input_len: int = 64, output_len: int = 64) -> list[SampleRequest]:
    """``heavy_fraction`` of the requests from the heavy client, sent first; the rest spread round-robin over
    ``num_light`` light clients. Every request has the same prompt and output length, so service shares compare
    directly."""
    if num_light < 1 or not 0 < heavy_fraction < 1:
        raise ValueError(f"multi-client: num_light={num_light}, heavy_fraction={heavy_fraction}: expected "
                         "num_light >= 1 and 0 < heavy_fraction < 1")
    rng = random.Random(seed)
    num_heavy = max(1, min(num_prompts - num_light, round(num_prompts * heavy_fraction)))
    users = [HEAVY_CLIENT] * num_heavy + [f"{LIGHT_CLIENT}-{i % num_light + 1}" for i in range(num_prompts - num_heavy)]
    return [SampleRequest(windows.prompt(rng, input_len), input_len, output_len, user=u) for u in users]


# ``priority``: a stream of low-priority load with a few high-priority requests spread through it, the first after a
# quarter of the stream (so they arrive at a loaded server); every request has the same lengths, so the high-priority
# requests' TTFT under load compares directly with their TTFT alone.
HIGH_PRIORITY, LOW_PRIORITY = 0, 1  # vLLM's convention: the lower value is served first


def priority_mix(num_prompts: int, windows: TextWindows, seed: int = 0, num_high: int = 4, input_len: int = 64,
                 output_len: int = 32) -> list[SampleRequest]:
    first, span = num_prompts // 4, num_prompts - num_prompts // 4
    if not 1 <= num_high <= span:
        raise ValueError(f"priority: num_high={num_high} with num_prompts={num_prompts}: expected 1 <= num_high <= "
                         f"{span} (the requests after the first quarter)")
    rng = random.Random(seed)
    high = {first + (k * span) // num_high for k in range(num_high)}
    return [SampleRequest(windows.prompt(rng, input_len), input_len, output_len,
                          priority=HIGH_PRIORITY if i in high else LOW_PRIORITY) for i in range(num_prompts)]
