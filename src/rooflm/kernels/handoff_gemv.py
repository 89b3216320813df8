# One-row decode projections that hand the residual add and the next RMSNorm's statistic to each other, so the
# add + norm between them needs no kernel of its own.
#
# In a pre-norm decoder layer every norm sits between two projections: o_proj -> add + RMSNorm -> gate_up_proj, and
# down_proj -> add + RMSNorm -> the next layer's qkv_proj. At one decode row each of these norm kernels is a launch
# of a few microseconds on a step of ~200 launches, and the GPU drains and refills between kernels: on an H200
# (Llama-2-7B shapes, a CUDA graph of 32 layers' GEMVs) the 64 norms cost 2.4-2.5 us each in the chain, 0.16 ms a
# step, more than their bytes. The norm cannot move into one program of either projection, because its statistic
# needs the whole row, which many programs produce. Here it is split across the two:
#
#   * the producer (``gemv_add_sumsq``, ``EPI_ADD_SUMSQ`` in gemv.py) adds the residual to its sums, rounds the
#     result h to the dtype exactly as the add + norm kernel does (``rooflm/kernels/rmsnorm.py``) and stores it as the
#     new residual stream; beside it h * norm_weight (rounded), and each program the float32 sum of h^2 over its
#     slice of the row;
#   * the consumer (``rmsnorm_sumsq_gemv``, ``PRO_RMSNORM_SUMSQ``) is a plain GEMV of h * norm_weight whose finished
#     sums it scales by 1/rms, adding the producer's partial sums up for the statistic (the one-pass form of
#     ``rooflm/kernels/fused_gemv.py`` with neither a pass over the row nor the add). Its results differ from the
#     unfused norm + GEMV by about one rounding of the dtype (the norm's output is h * norm_weight rounded once, not
#     h / rms rounded and then scaled and rounded); the residual stream is bit-equal.
#
# Whether a pair is handed off is measured on the running device the first time a shape pair is seen: the two
# handoff kernels against the producer GEMV, the norm kernel and the consumer GEMV (with SiLU-and-mul in its epilogue
# for gate_up_proj), replayed from CUDA graphs over weight copies larger than the L2. ``ROOFLM_FUSED_GEMV=off`` turns
# it off with the other fusions; ``on`` hands off without the comparison.
from __future__ import annotations

import functools
import os

import torch
import triton

from rooflm.kernels._tl import pdl_supported
from rooflm.kernels._utils import HandoffLaunch, interpreting
from rooflm.kernels.gemv import (
    CANDIDATES, EPI_ADD_SUMSQ, EPI_NONE, EPI_SILU_MUL, PRO_NONE, PRO_RMSNORM_SUMSQ, GemvConfig, _short, check_weight,
    choose, launch_gemv, time_in_graph, weight_copies,
)


def _one_row(name: str, x: torch.Tensor, width: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape != (1, width) or x.stride(1) != 1:
        raise ValueError(f"{name} must be one contiguous row [1, {width}]; got {tuple(x.shape)} (strides {x.stride()})")
    return x


def _row_config(cfg: GemvConfig) -> None:
    if cfg.use_dot or cfg.split_k != 1:
        raise ValueError(f"the handoff GEMVs need a configuration without tl.dot or split-K; got {cfg}")


def gemv_add_sumsq(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N] or None
    cfg: GemvConfig,
    residual: torch.Tensor,  # [1, N]
    norm_weight: torch.Tensor,  # [N]: the next norm's weight
    pdl_wait: bool = False,
    pdl_trigger: int = 0,
    pdl_preload: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, sumsq) in one launch: h = x @ weight.T + bias + residual, the new residual stream, rounded as the add
    + norm kernel rounds it; y = h * norm_weight rounded, the next projection's input before 1/rms; sumsq (float32,
    one entry per program) partial sums of h^2, which complete the norm's statistic in ``rmsnorm_sumsq_gemv``.
    ``pdl_preload`` (with ``pdl_wait``, where the GPU launches so): each program loads its first weight tile before
    it waits, with the tile of ``preload_config(cfg, K)``."""
    K, N = x.shape[-1], weight.shape[0]
    _one_row("x", x, K)
    check_weight(weight, K, x.shape)
    _one_row("residual", residual, N)
    if norm_weight.shape != (N,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} does not match the projection's {N} rows")
    _row_config(cfg)
    if pdl_wait and pdl_preload and pdl_supported(x.device):
        cfg = preload_config(cfg, K)  # the tile that pays for its early load (same rows: the same partial sums)
    sumsq = torch.empty(triton.cdiv(N, cfg.block_n), dtype=torch.float32, device=x.device)
    h = torch.empty_like(residual)
    y = launch_gemv(x, K, weight, bias, cfg, PRO_NONE, residual, norm_weight.contiguous(), residual_out=h,
                    epilogue=EPI_ADD_SUMSQ, sumsq=sumsq, pdl_wait=pdl_wait, pdl_trigger=pdl_trigger,
                    pdl_preload=pdl_preload)
    return y, h, sumsq


# o_proj after decode attention, launched to wait for it in place (programmatic dependent launch): its programs are
# resident while attention runs, and attention at one row is a chain of memory round trips that leaves most of the
# bandwidth idle, so each program loads its first weight tile before it waits (the weights do not depend on
# attention). On an H200 (tests/gpu/decode_pdl_chain.py: Llama-2-7B's 32 layers at one row and 1k tokens, qkv ->
# attention -> o -> gate_up -> down in one CUDA graph) the chain took 3.574 ms with o_proj's picked 4 x 1024 tile,
# 3.570 with a 4 x 2048 tile and 3.525 with that tile loaded before the wait (half of each row). In a probe of the
# same chain, loading one or two 4 x 1024 tiles so was slower than loading none (3.604 and 3.578 against 3.560 ms):
# a narrow tile covers too little of the row and holds registers through the loop. So the preloading launch takes a
# tile PRELOAD_BLOCK_K wide where the picked tile is narrower, within the register budget of the picked rows (at most
# 8192 products a program).
#
# Between two projections the same launch pays only where the first lets the second in late. With each GEMV
# triggering at its start, the next GEMV's programs sit on the multiprocessors through the last wave of a
# several-wave grid; with the trigger after each program's main loop (``TRIGGER_LATE``) they arrive for its drain.
# Batch-1 decode of Llama-2-7B in float16 on an H200 (``rooflm bench latency``, 1024 + 128 tokens, variants
# alternated in one call): 3.794-3.798 ms with only the boundaries around attention and o_proj -> gate_up_proj
# launched so; gate_up_proj -> down_proj triggered late 3.770, triggered at the start 3.793-3.798; with down_proj ->
# the next qkv_proj late as well 3.744-3.750; gate_up_proj and the next qkv_proj loading their first weight tile
# before they wait as well **3.709-3.720** (these launches, with the tiles each pair picked under plain launches;
# timing the pairs under these launches, ``pick_handoff(..., launch)``, then gave 3.56-3.62 ms on two cards).
# down_proj preloading, two tiles preloaded, o_proj triggering late and the triggers left to the programs' ends
# (implicit) were no faster.
PRELOAD_BLOCK_K = 2048


@functools.lru_cache(maxsize=None)
def preload_config(cfg: GemvConfig, K: int) -> GemvConfig:
    """The tile ``gemv_add_sumsq(..., pdl_wait=True, pdl_preload=True)`` takes after decode attention: cfg with
    PRELOAD_BLOCK_K columns where that tile divides K, is wider than cfg's and fits the budget; cfg otherwise."""
    if (cfg.use_dot or cfg.split_k != 1 or cfg.block_k >= PRELOAD_BLOCK_K or K % PRELOAD_BLOCK_K
            or cfg.block_n * PRELOAD_BLOCK_K > 8192):
        return cfg
    return GemvConfig(False, cfg.block_n, PRELOAD_BLOCK_K, 1, cfg.num_warps, cfg.num_stages)


def rmsnorm_sumsq_gemv(
    y: torch.Tensor,  # [1, K]: h * norm_weight from gemv_add_sumsq
    sumsq: torch.Tensor,  # h's partial sums of squares
    eps: float,
    weight: torch.Tensor,  # [N, K] ([gate | up] rows with silu_mul)
    bias: torch.Tensor | None,
    cfg: GemvConfig,
    silu_mul: bool = False,
    pdl_trigger: int = 0,
    pdl_wait: bool = False,
    pdl_preload: bool = False,
) -> torch.Tensor:
    """rms_norm(h) @ weight.T + bias = (y @ weight.T) / rms(h) + bias in one launch, rms(h) from ``sumsq``; with
    ``silu_mul`` silu(gate) * up of that product (the epilogue of ``rooflm.kernels.fused_gemv.gemv_silu_mul``).
    ``pdl_trigger``, ``pdl_wait``, ``pdl_preload`` (here and in ``gemv_add_sumsq``): programmatic dependent launch
    (``launch_gemv``; the first weight tile, at the picked tile)."""
    K = y.shape[-1]
    _one_row("y", y, K)
    if sumsq.dim() != 1 or sumsq.dtype != torch.float32:
        raise ValueError(f"sumsq must be a float32 vector; got {sumsq.dtype} {tuple(sumsq.shape)}")
    check_weight(weight, K, y.shape)
    _row_config(cfg)
    return launch_gemv(y, K, weight, bias, cfg, PRO_RMSNORM_SUMSQ, eps=eps,
                       epilogue=EPI_SILU_MUL if silu_mul else EPI_NONE, sumsq=sumsq, pdl_trigger=pdl_trigger,
                       pdl_wait=pdl_wait, pdl_preload=pdl_preload)


def gemv_add_sumsq_ref(x, weight, bias, residual, norm_weight):
    """The twin: torch's linear rounded to the dtype, the add as the norm kernel rounds it, h * norm_weight, the
    total sum of squares."""
    h = (torch.nn.functional.linear(x, weight, bias).float() + residual.float()).to(x.dtype)
    return (h.float() * norm_weight.float()).to(x.dtype), h, h.float().pow(2).sum().reshape(1)


def rmsnorm_sumsq_gemv_ref(h, norm_weight, eps, weight, bias=None, silu_mul=False):
    """The twin: the unfused reference norm of h (no add), then torch's linear (and the activation's reference)."""
    from rooflm.kernels.activation import silu_and_mul_ref
    from rooflm.kernels.rmsnorm import rms_norm_ref

    out = torch.nn.functional.linear(rms_norm_ref(h, norm_weight, eps), weight, bias)
    return silu_and_mul_ref(out) if silu_mul else out


# ---------------------------------------------------------------------------------------------------------------------
# Measure and pick: (producer configuration, consumer configuration), or None for the unfused three launches
# ---------------------------------------------------------------------------------------------------------------------
_choices: dict[tuple, tuple[GemvConfig, GemvConfig] | None] = {}
INTERPRETER_PICK = (GemvConfig(False, 16, 64), GemvConfig(False, 16, 64))  # CPU tests: small tiles, no timing


def _row_configs() -> list[GemvConfig]:
    return [c for c in CANDIDATES if not c.use_dot and c.split_k == 1]


def _eligible(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1
            and all(w.dtype == x.dtype and w.dim() == 2 and w.stride(-1) == 1 for w in weights)
            and (x.is_cuda or interpreting()))


def pick_handoff(
    x: torch.Tensor,  # [1, K]: the producer's input
    producer: torch.Tensor, producer_bias: torch.Tensor | None,  # [N, K]
    consumer: torch.Tensor, consumer_bias: torch.Tensor | None,  # [N2, N]
    eps: float, silu_mul: bool,
    launch: HandoffLaunch | None = None,
) -> tuple[GemvConfig, GemvConfig] | None:
    """(producer, consumer) configurations for ``gemv_add_sumsq`` then ``rmsnorm_sumsq_gemv`` on rows like x, or
    None where the unfused launches (GEMV, add + norm kernel, GEMV) are faster or the inputs do not suit the
    kernels. Timed once per shape pair (and ``launch``) on CUDA; never inside a CUDA-graph capture. With ``launch``
    (where the GPU launches so) the pair is timed as the model launches it, over every producer tile (see
    ``_launched_producers``)."""
    if (not _eligible(x, producer, consumer) or producer.shape[1] != x.shape[1]
            or consumer.shape[1] != producer.shape[0]):
        return None
    if silu_mul and consumer.shape[0] % 2:
        return None
    if interpreting():
        return INTERPRETER_PICK
    if launch is not None and not pdl_supported(x.device):
        launch = None
    key = (tuple(producer.shape), tuple(consumer.shape), x.dtype, producer_bias is not None,
           consumer_bias is not None, silu_mul, x.device, launch)
    if key in _choices:
        return _choices[key]
    if torch.cuda.is_current_stream_capturing():
        return None  # no timing inside a capture; the runner warms up every bucket eagerly first
    from rooflm.kernels.fused_gemv import fused_gemv_mode

    mode = fused_gemv_mode()
    if mode == "off" or os.environ.get("ROOFLM_GEMV", "auto") == "off":
        _choices[key] = None
        return None
    if launch is None:
        first = choose(x, producer, producer_bias)  # the producer keeps its own tile where that is a row tile
        producer_cfgs = [first] if isinstance(first, GemvConfig) and first in _row_configs() else _row_configs()[:1]
    else:
        producer_cfgs = _launched_producers(launch, x.shape[1])
    variants = [(p, c) for p in producer_cfgs for c in _row_configs() if not silu_mul or c.block_n >= 2]
    results = _time_pairs(x, producer, producer_bias, consumer, consumer_bias, eps, silu_mul, variants, mode,
                          launch)
    pick = results[0][1]
    if os.environ.get("ROOFLM_GEMV", "auto") == "verbose":
        print(f"[rooflm.handoff_gemv] {tuple(producer.shape)} -> {tuple(consumer.shape)} silu_mul={silu_mul}: "
              + ", ".join(("unfused" if v is None else f"{_short(v[0])}/{_short(v[1])}") + f"={t * 1e3:.1f}us"
                          for t, v in results))
    _choices[key] = pick
    return pick


def _launched_producers(launch: HandoffLaunch, K: int) -> list[GemvConfig]:
    """The producer tiles ``pick_handoff`` times under ``launch``. Under programmatic dependent launch the tile that
    runs fastest alone is not the one that does in the step (Llama-2-7B on an H200, the engine's launches of 32
    layers in one CUDA graph: gate_up_proj's 4 x 1024 tile 3.50 ms against 3.57 for the 32 x 256 picked alone,
    down_proj's 4 x 1024 3.48 against 3.50 for 8 x 512; docs/benchmarks.md), so every row tile is timed. A producer
    that loads its first tile before it waits for decode attention takes one that ``preload_config`` widens where
    there is one: that wide first load is what overlaps attention (o_proj's 4 x 1024, widened, 3.51 ms against 3.61
    for 8 x 512 with gate_up_proj's 4 x 1024; 3.58 against 3.62 for 16 x 512 with its 32 x 256), and the pair's
    timing has no attention in it to show it."""
    cfgs = _row_configs()
    if launch.producer_preload:
        wide = [c for c in cfgs if preload_config(c, K) != c]
        cfgs = wide or cfgs
    return cfgs


def _time_pairs(x, producer, producer_bias, consumer, consumer_bias, eps, silu_mul, variants, mode, launch=None):
    from rooflm.kernels.fused_gemv import linear_silu_mul
    from rooflm.kernels.gemv import linear
    from rooflm.kernels.rmsnorm import rms_norm

    dev = x.device
    xs = torch.randn_like(x)
    res = torch.randn(1, producer.shape[0], dtype=x.dtype, device=dev)
    nw = torch.ones(producer.shape[0], dtype=x.dtype, device=dev)
    pairs = list(zip(weight_copies(producer), weight_copies(consumer)))

    def unfused(w):
        h, _ = rms_norm(linear(xs, w[0], producer_bias), nw, eps, res)
        return linear_silu_mul(h, w[1], consumer_bias) if silu_mul else linear(h, w[1], consumer_bias)

    first, then = (launch.producer(), launch.consumer()) if launch is not None else ({}, {})

    def fused(v, w):
        y, _, ss = gemv_add_sumsq(xs, w[0], producer_bias, v[0], res, nw, **first)
        return rmsnorm_sumsq_gemv(y, ss, eps, w[1], consumer_bias, v[1], silu_mul, **then)

    results: list[tuple[float, tuple[GemvConfig, GemvConfig] | None]] = []
    if mode == "auto":
        results.append((time_in_graph(unfused, pairs, dev), None))
    for v in variants:
        results.append((time_in_graph(lambda w, v=v: fused(v, w), pairs, dev), v))
    results.sort(key=lambda r: r[0])
    return results


# ---------------------------------------------------------------------------------------------------------------------
# The same two halves for packed (quantized) weights, in the one-row word GEMV (rooflm/kernels/quant_gemv.py)
# ---------------------------------------------------------------------------------------------------------------------
def packed_add_sumsq(x: torch.Tensor, pw, bias: torch.Tensor | None, cfg, residual: torch.Tensor,
                     norm_weight: torch.Tensor, pdl_wait: bool = False, pdl_trigger: int = 0,
                     pdl_preload: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gemv_add_sumsq`` for a packed weight ``pw`` (a ``PackedWeight``) through the word GEMV with ``cfg``."""
    from rooflm.kernels.quant_gemv import launch_gemv as word_gemv

    N = pw.out_features
    _one_row("x", x, pw.in_features)
    _one_row("residual", residual, N)
    if norm_weight.shape != (N,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} does not match the projection's {N} rows")
    if pw.perm is not None:  # act-order: x's columns in the order of the packed rows
        x = x.index_select(1, pw.perm)
    sumsq = torch.empty(triton.cdiv(N, cfg.block_n), dtype=torch.float32, device=x.device)
    h = torch.empty_like(residual)
    y = word_gemv(x, pw, bias, cfg, add_sumsq=(residual, norm_weight.contiguous(), h, sumsq), pdl_wait=pdl_wait,
                  pdl_trigger=pdl_trigger, pdl_preload=pdl_preload)
    return y, h, sumsq


def packed_rmsnorm_sumsq_gemv(y: torch.Tensor, sumsq: torch.Tensor, eps: float, pw, bias: torch.Tensor | None, cfg,
                              silu_mul: bool = False, pdl_trigger: int = 0, pdl_wait: bool = False,
                              pdl_preload: bool = False) -> torch.Tensor:
    """``rmsnorm_sumsq_gemv`` for a packed weight through the word GEMV with ``cfg``."""
    from rooflm.kernels.quant_gemv import launch_gemv as word_gemv

    _one_row("y", y, pw.in_features)
    if sumsq.dim() != 1 or sumsq.dtype != torch.float32:
        raise ValueError(f"sumsq must be a float32 vector; got {sumsq.dtype} {tuple(sumsq.shape)}")
    if pw.perm is not None:
        y = y.index_select(1, pw.perm)
    return word_gemv(y, pw, bias, cfg, silu_mul=silu_mul, rstd_sumsq=sumsq, eps=eps, pdl_trigger=pdl_trigger,
                     pdl_wait=pdl_wait, pdl_preload=pdl_preload)


# Which packed widths time their pairs under the model's launch plan. Llama-2-7B on an H200 (batch-1 decode, 1024 +
# 128, docs/benchmarks.md): 8 bits 2.57-2.59 -> 2.47-2.48 ms with the pairs so timed; 4 bits 2.15 -> 2.16-2.20 ms,
# the pair timings under the plan (26-29 us, close together) not ranking the tiles as the step does, so 4-bit pairs
# keep the tiles each projection picks alone.
PLAN_TIMED_BITS = (8,)


def pick_handoff_packed(x: torch.Tensor, producer, producer_bias: torch.Tensor | None, consumer,
                        consumer_bias: torch.Tensor | None, eps: float, silu_mul: bool,
                        launch: HandoffLaunch | None = None):
    """``pick_handoff`` for two packed weights: the word GEMV configurations each projection runs alone (for
    gate_up_proj its SiLU-and-mul epilogue's), handed over where that was measured faster than the two with the
    norm kernel between them; None where either projection does not run the word GEMV. With ``launch`` (where the GPU
    launches so) the pair of 8-bit weights is timed as the model launches it over the word GEMV's candidate tiles of
    both halves (``_packed_variants``), as ``pick_handoff`` does for float weights (see ``PLAN_TIMED_BITS``)."""
    from rooflm.kernels._utils import device_sms
    from rooflm.kernels.quant_gemv import (default_gemv_config, packed_copies, pick_gemv, pick_gemv_silu_mul,
                                           short_name, supports)
    from rooflm.kernels.quant_gemv_mma import MmaGemvConfig

    if (x.dim() != 2 or x.shape[0] != 1 or x.dtype not in (torch.float16, torch.bfloat16)
            or producer.out_features != consumer.in_features or not (x.is_cuda or interpreting())
            or not supports(x, producer) or not supports(x, consumer)):  # (supports reads x's row count only)
        return None
    if launch is not None and (not pdl_supported(x.device) or producer.bits not in PLAN_TIMED_BITS
                               or consumer.bits not in PLAN_TIMED_BITS):
        launch = None
    key = ("packed", producer.out_features, producer.in_features, consumer.out_features, producer.bits,
           consumer.bits, producer.group_size, consumer.group_size, producer_bias is not None,
           consumer_bias is not None, silu_mul, x.dtype, x.device, launch, producer.mma is not None,
           consumer.mma is not None)
    if key in _choices:
        return _choices[key]
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    from rooflm.kernels.fused_gemv import fused_gemv_mode

    if capturing or fused_gemv_mode() == "off":
        return None
    y = torch.randn(1, consumer.in_features, dtype=x.dtype, device=x.device)

    def word(v, pw, bias, silu):  # the projection's own timed pick, else the static word GEMV configuration
        cfg = (pick_gemv_silu_mul(v, pw, bias) if silu else None) or pick_gemv(v, pw, bias)
        return cfg or default_gemv_config(pw.out_features, pw.in_features, pw.bits, pw.group_size, device_sms(v))

    first, then = word(x, producer, producer_bias, False), word(y, consumer, consumer_bias, silu_mul)
    # The tensor-core GEMV (rooflm/kernels/quant_gemv_mma.py) has no handoff epilogue: where a projection picked it,
    # the unfused pair runs it and the handed-over pair the word GEMV's static tile.
    fw, tw = (c if not isinstance(c, MmaGemvConfig) else default_gemv_config(pw.out_features, pw.in_features,
                                                                              pw.bits, pw.group_size, device_sms(x))
              for c, pw in ((first, producer), (then, consumer)))
    pick = None if fw is None or tw is None or (silu_mul and tw.block_n < 2) else (fw, tw)
    if pick is not None and not interpreting() and fused_gemv_mode() == "auto":
        from rooflm.kernels.quant_gemv import gemv_silu_mul
        from rooflm.kernels.quant_gemv import launch_gemv as word_gemv
        from rooflm.kernels.activation import silu_and_mul
        from rooflm.kernels.rmsnorm import rms_norm

        res = torch.randn(1, producer.out_features, dtype=x.dtype, device=x.device)
        nw = torch.ones(producer.out_features, dtype=x.dtype, device=x.device)
        pairs = list(zip(packed_copies(producer), packed_copies(consumer)))
        plan = (launch.producer(), launch.consumer()) if launch is not None else ({}, {})

        def unfused(w):
            h, _ = rms_norm(word_gemv(x, w[0], producer_bias, first), nw, eps, res)
            if silu_mul and isinstance(then, MmaGemvConfig):
                return silu_and_mul(word_gemv(h, w[1], consumer_bias, then))
            return (gemv_silu_mul(h, w[1], consumer_bias, then) if silu_mul
                    else word_gemv(h, w[1], consumer_bias, then))

        def fused(v, w):
            y2, _, ss = packed_add_sumsq(x, w[0], producer_bias, v[0], res, nw, **plan[0])
            return packed_rmsnorm_sumsq_gemv(y2, ss, eps, w[1], consumer_bias, v[1], silu_mul, **plan[1])

        variants = [pick] + ([v for v in _packed_variants(producer, consumer, silu_mul, device_sms(x)) if v != pick]
                             if launch is not None else [])
        results = [(time_in_graph(unfused, pairs, x.device), None)]
        results += [(time_in_graph(lambda w, v=v: fused(v, w), pairs, x.device), v) for v in variants]
        results.sort(key=lambda r: r[0])
        if os.environ.get("ROOFLM_GEMV", "auto") == "verbose":
            print(f"[rooflm.handoff_gemv] packed {key[1:4]} silu_mul={silu_mul} launch={launch is not None}: "
                  + ", ".join(("unfused" if v is None else f"{short_name(v[0])}/{short_name(v[1])}")
                              + f"={t * 1e3:.1f}us" for t, v in results[:8]))
        pick = results[0][1]
    _choices[key] = pick
    return pick


def _packed_variants(producer, consumer, silu_mul: bool, sms: int) -> list[tuple]:
    """Every (producer, consumer) pair of the word GEMV's candidate tiles (``gemv_candidates``; the consumer's with
    SiLU-and-mul unsplit and of at least two rows), for timing under a launch plan: as for float weights, the tile a
    projection runs fastest alone need not be the one that runs fastest between its neighbours. Never the wide
    list of ``ROOFLM_QUANT_GEMV=wide`` (its square is too many pairs to time; each projection's own pick, which
    may come from it, is timed first anyway)."""
    from rooflm.kernels.quant_gemv import gemv_candidates

    def cands(pw, silu: bool):
        return [c for c in gemv_candidates(pw.out_features, pw.in_features, pw.bits, pw.group_size, sms, wide=False)
                if c is not None and (not silu or (c.split_k == 1 and c.block_n >= 2))]
    return [(p, c) for p in cands(producer, False) for c in cands(consumer, silu_mul)]


def choices() -> dict[tuple, tuple[GemvConfig, GemvConfig] | None]:
    """What was picked so far, for reports: {(producer shape, consumer shape, dtype, biases, silu_mul, device): the
    pick, None = unfused}."""
    return dict(_choices)
