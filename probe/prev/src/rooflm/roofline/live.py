"""The live roofline: for every executed engine step, its best possible time on this device, and how close the step
came to it (best possible / measured).

A step is described by its composition: per scheduled request the tokens computed this step (``query_lens``, q_i)
and the context after the step (``context_lens``, c_i), and how many rows go through the LM head. Its best possible
time uses the analyzer's operators (``rooflm.roofline.ops``) with flash attention and logits only for the sampled
rows, timed as the analyzer times them (``max(OPs / peak, bytes / bandwidth)`` per operator):

- everything but attention and the LM head depends only on the total token count T = Σ q_i: cached per T;
- the LM head depends only on the number of sampled rows: cached per row count;
- attention is one fused operator per layer over the whole batch. Its bytes are Q and O (linear in T) plus the K and V
  read (linear in Σ keys_i, keys_i = c_i without a sliding window); its OPs are linear in the (query, key) pairs,
  Σ (q_i·c_i - q_i·(q_i-1)/2) under a causal mask. The coefficients come from the analyzer's own attention operator,
  so the two cannot drift. A step's chunk of q new tokens ending at context c generalizes the analyzer's stages:
  prefill is q = c, decode q = 1.

``python -m rooflm.roofline.live --bench`` prints the cost of one ``predict`` call."""
from __future__ import annotations

import bisect
import math
import operator
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from rooflm.roofline.analyzer import _Ctx
from rooflm.roofline.hardware import Hardware, get_hardware
from rooflm.roofline.ops import Counting, Dims, OpCount, attention_ops, block_ops, causal_pairs, model_ops
from rooflm.roofline.precision import Format, Precision, compute_key

if TYPE_CHECKING:
    import torch

    from rooflm.config import ModelConfig
    from rooflm.engine.stats import EngineStats

RECENT_STEPS = 256  # steps whose fractions ``fraction_quantile`` ranks: the recent pace, not the whole run's
# Upper bounds of the per-step fraction histogram (Prometheus "le" semantics: a step with fraction f counts in the
# first bucket whose bound is >= f). Fractions above 1 mean the step beat the model of its best time.
FRACTION_BUCKETS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, float("inf"))

# torch dtype name -> bit-width name of rooflm.roofline.precision
_DTYPE_BITS = {"float32": "32", "float16": "16", "bfloat16": "bf16", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
               "int8": "8"}
_HEAD_OPS = ("lm_head", "logits_allgather")  # model-level operators that run once per sampled row
# Σ a_i·b_i: math.sumprod (Python >= 3.12) is several times faster than summing a map.
_sumprod = getattr(math, "sumprod", None) or (lambda a, b: sum(map(operator.mul, a, b)))


def dtype_bits(dtype: "torch.dtype | str") -> str:
    """The analyzer's bit-width name of a torch dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BITS:
        raise ValueError(f"dtype={dtype!r} is invalid: expected one of {', '.join(_DTYPE_BITS)}")
    return _DTYPE_BITS[name]


def measure_quick(device: str, dtype: "torch.dtype | None" = None) -> Hardware:
    """This device's ceilings in a fraction of a second (``rooflm.roofline.measure`` with small sizes): copy
    bandwidth and the matmul rate in ``dtype`` (fp32 when it is not a float type ``measure`` knows)."""
    import torch

    from rooflm.roofline.measure import measure_bandwidth, measure_matmul_peak

    device = str(device)
    cuda = device.startswith("cuda")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        dtype = torch.float16 if cuda else torch.float32
    # CUDA: 256 MiB copies and an 8192^3 matmul take milliseconds and reach the device's sustained rates; the CPU
    # gets 32 MiB (beyond the last-level cache of common CPUs) and 768^3 (tens of milliseconds: 256^3 measured a
    # twentieth of the rate on a 2-core machine, the call overhead dominating).
    bw = measure_bandwidth(device, nbytes=(256 if cuda else 32) * 2**20, reps=5 if cuda else 3)
    key, peak = measure_matmul_peak(device, n=8192 if cuda else 768, reps=3, dtype=dtype)
    if cuda:
        idx = torch.device(device).index or 0
        name, mem = torch.cuda.get_device_name(idx), float(torch.cuda.get_device_properties(idx).total_memory)
        torch.cuda.empty_cache()
    else:
        name, mem = f"CPU ({torch.get_num_threads()} threads)", 16.0 * 2**30
    return Hardware(name=name, memory_bandwidth=bw, memory_bytes=mem, peak_ops={key: peak}, kind="measured",
                    source=f"measured with torch {torch.__version__} on {device}", key="measured")


@dataclass(frozen=True)
class _AttentionCoefficients:
    """Per-layer attention of a step: OPs = per_pair·pairs; bytes = per_token·T + per_key·keys."""

    per_pair: float
    per_token: float
    per_key: float
    peak: float  # OPs/s the analyzer times this operator at


def _mem(op: OpCount) -> float:
    return op.load_weight + op.load_act + op.load_kv + op.store_act + op.store_kv


class LiveRoofline:
    """Best possible time of engine steps, and the running fraction of it that executed steps reached.

    model_config: the served model; dtype: weights and activations (torch dtype); kv_dtype: the KV cache (default
    ``dtype``); hardware: the ceilings (``for_engine`` measures them or takes a catalog entry); tp: tensor-parallel
    degree (figures per GPU, each step's collectives free where ``hardware`` gives no interconnect bandwidth, as
    measured ceilings do not); expert_parallel: a MoE model's experts split whole over the ``tp`` GPUs, each layer
    waiting for the GPU whose experts the step touched most; weight_format: the format of the quantized projection
    weights, with the bytes per element the model's packed weights really take
    (``rooflm.quantization.apply.weight_format``), None for float weights in ``dtype``."""

    def __init__(self, model_config: "ModelConfig", dtype: "torch.dtype | str", hardware: Hardware, *,
                 kv_dtype: "torch.dtype | str | None" = None, tp: int = 1, expert_parallel: bool = False,
                 weight_format: "Format | None" = None) -> None:
        if not isinstance(hardware, Hardware):
            raise ValueError(f"hardware={hardware!r} is invalid: expected a rooflm.roofline.Hardware")
        if weight_format is not None and not isinstance(weight_format, Format):
            raise ValueError(f"weight_format={weight_format!r} is invalid: expected a rooflm.roofline.precision."
                             "Format or None")
        bits = dtype_bits(dtype)
        p = Precision.of(bits, bits, dtype_bits(kv_dtype) if kv_dtype is not None else bits)
        if weight_format is not None:
            p = replace(p, weight=weight_format)
        self.hardware = hardware
        self.model_config = model_config
        self.tp = tp
        # the bound of one GPU's share; without a link figure the collectives count as free (a lower bound)
        ctx_hw = replace(hardware, interconnect_bandwidth=float("inf")) if (
            tp > 1 and hardware.interconnect_bandwidth is None) else hardware
        self._x = _Ctx(Dims.of(model_config, tp, expert_parallel), p,
                       Counting(flash_attention=True, prefill_logits="last"), ctx_hw)
        self._layers = self._x.d.layers
        self._window = self._x.d.window
        self._attn = self._attention_coefficients()
        self._attn_names = frozenset(op.name for op in attention_ops(self._x.d, p, self._x.c, "decode", 1, 1, 1))
        self._body: dict[int, float] = {}  # T -> seconds of every operator but attention and the LM head
        self._head: dict[int, float] = {0: 0.0}  # sampled rows -> seconds of the LM head (none: not run)
        self.analyzer_calls = 0  # operator lists built on cache misses (for tests of the caches)
        self.reset()

    @classmethod
    def for_engine(cls, model_config: "ModelConfig", dtype: "torch.dtype | str", device: "str | Any",
                   hardware: str | None = None, **kw: Any) -> "LiveRoofline":
        """The live roofline of an engine: ``hardware`` names a catalog entry (``"h100-sxm"``), or None to measure
        this device's copy bandwidth and matmul rate quickly (milliseconds on a GPU, about 0.1 s on a CPU)."""
        if hardware is not None:
            hw = get_hardware(hardware)
        else:
            import torch

            hw = measure_quick(str(device), dtype if isinstance(dtype, torch.dtype) else None)
        return cls(model_config, dtype, hw, **kw)

    # -- set-up ---------------------------------------------------------------------------------------------------------
    def _attention_coefficients(self) -> _AttentionCoefficients:
        """Read the per-pair, per-token and per-key costs off the analyzer's fused attention operator (one decode
        token attending to 1 and to 2 keys) and check that it is linear as assumed."""
        x = self._x

        def op(batch: int, q: int, ctx: int, stage: str = "decode") -> OpCount:
            (o,) = attention_ops(x.d, x.p, x.c, stage, batch, q, ctx)
            return o

        one, two = op(1, 1, 1), op(1, 1, 2)
        per_pair, per_key = two.ops - one.ops, _mem(two) - _mem(one)
        per_token = _mem(one) - per_key
        check = op(3, 5, 5, "prefill")  # 3 prompts of 5 tokens: 15 pairs and 5 keys each
        if (abs(check.ops - per_pair * 3 * 15) > 1e-9 * check.ops
                or abs(_mem(check) - per_token * 15 - per_key * 15) > 1e-9 * _mem(check)):
            raise ValueError("the analyzer's attention operator is not linear in pairs, tokens and keys")
        key = compute_key(x.fmt(one.operands[0]), x.fmt(one.operands[1]), x.hw.peak_ops)
        return _AttentionCoefficients(per_pair, per_token, per_key, x.hw.peak(key))

    def _body_time(self, tokens: int) -> float:
        x = self._x
        self.analyzer_calls += 1
        block = [o for o in block_ops(x.d, x.p, x.c, "decode", tokens, 1, 1) if o.name not in self._attn_names]
        model = [o for o in model_ops(x.d, x.p, x.c, "decode", tokens, 1) if o.name not in _HEAD_OPS]
        return self._layers * sum(x.timing(o)[0] for o in block) + sum(x.timing(o)[0] for o in model)

    def _head_time(self, rows: int) -> float:
        x = self._x
        self.analyzer_calls += 1
        return sum(x.timing(o)[0] for o in model_ops(x.d, x.p, x.c, "decode", rows, 1) if o.name in _HEAD_OPS)

    def prefill_chunk_tokens(self, ratio: float = 2.0, limit: int = 8192) -> int:
        """The most prompt tokens (a power of two, at most ``limit``) one step of a single request can compute within
        ``ratio`` times the best time of a one-token decode step. Below the roofline's ridge a step costs one read
        of the weights whatever its tokens, so this is small where compute is scarce (a CPU) and large on a GPU."""
        budget = ratio * self.predict([1], [1], 1)
        t = 1
        while t * 2 <= limit and self.predict([t * 2], [t * 2], 1) <= budget:
            t *= 2
        return t

    # -- prediction -----------------------------------------------------------------------------------------------------
    def predict(self, query_lens: Sequence[int], context_lens: Sequence[int], num_logit_rows: int) -> float:
        """Best possible seconds of one step. query_lens[i] >= 1 tokens computed for request i, ending at
        context_lens[i] >= query_lens[i] tokens; num_logit_rows rows through the LM head (0 to T)."""
        n = len(query_lens)
        if n != len(context_lens) or n < 1:
            raise ValueError(f"query_lens (length {n}) and context_lens (length {len(context_lens)}) are invalid: "
                             "expected equally long, non-empty sequences")
        keys = sum(context_lens)
        if query_lens.count(1) == n:  # every request computes one token (decode): one pair per key
            T, pairs = n, keys
            bad = min(context_lens) < 1
        else:
            T = sum(query_lens)
            bad = min(query_lens) < 1 or any(map(operator.gt, query_lens, context_lens))
            qc = _sumprod(query_lens, context_lens)
            qq = _sumprod(query_lens, query_lens)
            pairs = qc - (qq - T) // 2  # Σ q·c - q(q-1)/2: the causal triangle of each chunk
        if bad:
            raise ValueError(f"query_lens={list(query_lens)!r}, context_lens={list(context_lens)!r} are invalid: "
                             "expected 1 <= query_len <= context_len for every request")
        if self._window is not None and max(context_lens) > self._window:
            keys, pairs = self._windowed(query_lens, context_lens)
        body = self._body.get(T)
        if body is None:
            body = self._body[T] = self._body_time(T)
        head = self._head.get(num_logit_rows)
        if head is None:
            if not 0 <= num_logit_rows <= T:
                raise ValueError(f"num_logit_rows={num_logit_rows!r} is invalid: expected 0..{T} (tokens this step)")
            head = self._head[num_logit_rows] = self._head_time(num_logit_rows)
        a = self._attn
        t_mem = (a.per_token * T + a.per_key * keys) / self._x.hw.memory_bandwidth
        t_ops = a.per_pair * pairs / a.peak
        return body + head + self._layers * (t_ops if t_ops > t_mem else t_mem)

    def _windowed(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> tuple[int, int]:
        """(keys, pairs) under a sliding window W: a chunk of q queries ending at c reads the keys some query sees,
        min(c, q + W - 1), and computes Σ_{p=c-q+1..c} min(p, W) pairs."""
        W = self._window
        assert W is not None
        keys = pairs = 0
        for q, c in zip(query_lens, context_lens):
            keys += min(c, q + W - 1)
            pairs += causal_pairs(c, W) - causal_pairs(c - q, W)
        return keys, pairs

    def reference_time(self, query_lens: Sequence[int], context_lens: Sequence[int], num_logit_rows: int) -> float:
        """``predict`` without caches or closed forms: the analyzer's operators of the whole step, attention summed
        over the requests (each one's prefill-style chunk: its own attention operator) into one fused operator.
        Slow; for checking ``predict``."""
        x = self._x
        T = sum(query_lens)
        rows = [o for o in block_ops(x.d, x.p, x.c, "decode", T, 1, 1) if o.name not in self._attn_names]
        total = self._layers * sum(x.timing(o)[0] for o in rows)
        total += sum(x.timing(o)[0] for o in model_ops(x.d, x.p, x.c, "decode", T, 1) if o.name not in _HEAD_OPS)
        if num_logit_rows:
            total += sum(x.timing(o)[0] for o in model_ops(x.d, x.p, x.c, "decode", num_logit_rows, 1)
                         if o.name in _HEAD_OPS)
        ops = load_act = load_kv = store_act = 0.0
        for q, c in zip(query_lens, context_lens):
            if q == 1:
                (o,) = attention_ops(x.d, x.p, x.c, "decode", 1, 1, c)
            else:  # a chunk ending at c: the prompt of c tokens minus the one of c - q tokens
                (full,) = attention_ops(x.d, x.p, x.c, "prefill", 1, c, c)
                (done,) = (attention_ops(x.d, x.p, x.c, "prefill", 1, c - q, c - q) if c > q else
                           (OpCount("none", "attention", 0.0),))
                # keys some query at positions c-q+1..c sees: from max(1, c-q+1 - (W-1)) to c
                seen = c if x.d.window is None else c - max(1, c - q + 2 - x.d.window) + 1
                (keys,) = attention_ops(x.d, x.p, x.c, "prefill", 1, 1, seen)
                o = OpCount("chunk", "attention", full.ops - done.ops, load_act=full.load_act - done.load_act,
                            load_kv=keys.load_kv, store_act=full.store_act - done.store_act)
            ops, load_act, load_kv, store_act = (ops + o.ops, load_act + o.load_act, load_kv + o.load_kv,
                                                 store_act + o.store_act)
        (proto,) = attention_ops(x.d, x.p, x.c, "decode", 1, 1, 1)
        fused = OpCount("fused_attention", "attention", ops, load_act=load_act, load_kv=load_kv, store_act=store_act,
                        operands=proto.operands)
        return total + self._layers * x.timing(fused)[0]

    # -- observation ----------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every observed step."""
        self.num_steps = 0
        self.predicted_s = 0.0
        self.measured_s = 0.0
        self.fraction_sum = 0.0
        self.last_fraction: float | None = None
        self.bucket_counts = [0] * len(FRACTION_BUCKETS)
        self.recent_fractions: deque[float] = deque(maxlen=RECENT_STEPS)

    def observe(self, query_lens: Sequence[int], context_lens: Sequence[int], num_logit_rows: int,
                measured_seconds: float) -> float:
        """Record one executed step that took ``measured_seconds``; returns its best possible / measured time."""
        if not measured_seconds > 0:
            raise ValueError(f"measured_seconds={measured_seconds!r} is invalid: expected a positive duration")
        predicted = self.predict(query_lens, context_lens, num_logit_rows)
        f = predicted / measured_seconds
        self.num_steps += 1
        self.predicted_s += predicted
        self.measured_s += measured_seconds
        self.fraction_sum += f
        self.last_fraction = f
        self.bucket_counts[bisect.bisect_left(FRACTION_BUCKETS, f)] += 1
        self.recent_fractions.append(f)
        return f

    def fraction_quantile(self, q: float) -> float | None:
        """The q-quantile (0 < q <= 1; nearest rank) of the fractions of the last ``RECENT_STEPS`` steps, None before
        the first. A low quantile is the pace of the slow steps: what a deadline has to plan for, where the mean
        ``fraction`` plans for the typical step (SLO admission, ``rooflm.engine.admission``)."""
        if not 0 < q <= 1:
            raise ValueError(f"q={q!r} is invalid: expected 0 < q <= 1")
        if not self.recent_fractions:
            return None
        ordered = sorted(self.recent_fractions)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    @property
    def fraction(self) -> float | None:
        """Σ best possible / Σ measured over the observed steps (None before the first)."""
        return self.predicted_s / self.measured_s if self.num_steps else None

    def describe_hardware(self) -> str:
        """E.g. ``NVIDIA H200 measured: 4.20 TB/s, 760 TFLOP/s`` (the matmul peak the linear layers run at)."""
        hw, p = self.hardware, self._x.p
        peak = hw.peak(compute_key(p.weight, p.act, hw.peak_ops))
        how = "measured" if hw.kind == "measured" else "datasheet"
        from rooflm.units import bandwidth, flop_rate

        return f"{hw.name} {how}: {bandwidth(hw.memory_bandwidth)}, {flop_rate(peak)}"

    def fill_stats(self, stats: "EngineStats") -> None:
        """Copy the running figures into ``stats`` (immutable values: snapshots copied with copy.copy stay valid)."""
        stats.roofline_fraction = self.fraction
        stats.roofline_last_fraction = self.last_fraction
        stats.roofline_steps = self.num_steps
        stats.roofline_predicted_s = self.predicted_s
        stats.roofline_measured_s = self.measured_s
        stats.roofline_fraction_sum = self.fraction_sum
        stats.roofline_bucket_bounds = FRACTION_BUCKETS
        stats.roofline_bucket_counts = tuple(self.bucket_counts)
        stats.roofline_hardware = self.describe_hardware()


# -- reports ------------------------------------------------------------------------------------------------------------
def roofline_summary(stats: "EngineStats", since: "EngineStats | None" = None) -> dict[str, Any] | None:
    """The live-roofline figures of ``stats`` for a JSON report, or None when they were not measured. ``since``: an
    earlier snapshot of the same engine; the figures then cover only the steps after it."""
    if stats.roofline_fraction is None:
        return None
    pred, meas, steps = stats.roofline_predicted_s, stats.roofline_measured_s, stats.roofline_steps
    counts = stats.roofline_bucket_counts
    if since is not None and since.roofline_fraction is not None:
        pred, meas, steps = pred - since.roofline_predicted_s, meas - since.roofline_measured_s, \
            steps - since.roofline_steps
        counts = tuple(a - b for a, b in zip(counts, since.roofline_bucket_counts))
    if steps < 1 or meas <= 0:
        return None
    return {"fraction": pred / meas, "steps": steps, "predicted_s": pred, "measured_s": meas,
            "hardware": stats.roofline_hardware,
            "histogram": {("+Inf" if b == float("inf") else f"{b:g}"): c
                          for b, c in zip(stats.roofline_bucket_bounds, counts)}}


def roofline_line(summary: dict[str, Any] | None) -> str | None:
    """``roofline: steps ran at 81.3% of their best possible time (NVIDIA H200 measured: 4.2 TB/s, 760 TFLOP/s)``."""
    if not summary:
        return None
    return (f"roofline: steps ran at {summary['fraction']:.1%} of their best possible time "
            f"({summary['hardware']}; {summary['steps']} steps)")


def _bench() -> None:
    """µs per ``predict`` of decode batches of 1..256 requests and a mixed step, caches warm (as in serving)."""
    import random
    import time

    from rooflm.config import load_model_config

    live = LiveRoofline(load_model_config("llama-3-8b"), "bfloat16", get_hardware("h100-sxm"))
    rng = random.Random(0)
    cases = []
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        ctx = [rng.randint(16, 4096) for _ in range(b)]
        cases.append((f"decode batch {b}", [1] * b, ctx, b))
    for b in (64, 256):
        c = [1024] + [rng.randint(16, 4096) for _ in range(b - 1)]
        cases.append((f"mixed: 1 prefill chunk + {b - 1} decodes", [512] + [1] * (b - 1), c, b))
    cases.append(("prefill: 4 prompts of 1024", [1024] * 4, [1024] * 4, 4))
    total = 0.0
    for name, q, c, rows in cases:
        live.predict(q, c, rows)  # fill the caches
        reps = 20000
        t0 = time.perf_counter()
        for _ in range(reps):
            live.predict(q, c, rows)
        us = (time.perf_counter() - t0) / reps * 1e6
        total += us
        print(f"{name:<40} {us:6.2f} µs per predict")
    print(f"{'average':<40} {total / len(cases):6.2f} µs per predict")


if __name__ == "__main__":
    import sys

    if "--bench" in sys.argv[1:]:
        _bench()
    else:
        print(__doc__)
