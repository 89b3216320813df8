# Decode projections that do the elementwise op before them in their own prologue: one launch instead of two.
#
# Technique: prologue fusion into a memory-bound GEMV (as in FlashDecoding++, Hong et al. 2024, and TensorRT-LLM's
# fused norm + GEMM plugins). At decode (M <= 16 rows) a projection's cost is reading its weight; the input rows are
# a few KB that every program of the GEMV (``rooflm/kernels/gemv.py``) streams anyway, from the L2 after the first.
# So the GEMV can compute the op that produced its input itself, and the separate kernel, its launch and the round
# trip of the intermediate through memory disappear:
#
#   * rmsnorm_gemv: residual add + RMSNorm (Zhang & Sennrich 2019) before qkv_proj and gate_up_proj, two variants:
#       - two-pass (default): each program first takes sum((x + residual)^2) over the whole row (a short pass over
#         K), then streams W and feeds rms_norm(x + residual) * norm_weight to the product, with the roundings of
#         ``rooflm/kernels/rmsnorm.py`` (sum rounded to the dtype, statistic in float32, normalised row rounded,
#         then scaled and rounded again): the GEMV input equals the unfused norm's output up to the summation order
#         of the statistic;
#       - one-pass (``one_pass=True``; one row, one K split): the statistic is gathered in the same pass as the
#         product, which uses (x + residual) * norm_weight in float32, and 1/rms scales the finished sums. No
#         serial pass before the weight stream starts, but the GEMV input is not rounded to the dtype twice as in
#         the unfused norm: the results differ from it by about one rounding of the dtype (and are no less
#         accurate against exact arithmetic).
#     The new residual stream (x + residual) is written once, by the programs of the first column block (and first
#     K split), into a fresh buffer that no program of the launch reads.
#   * silu_mul_gemv: silu(gate) * up before down_proj. Programs read their K range of [gate | up] and feed
#     (silu(gate) rounded) * up rounded, the roundings of ``rooflm/kernels/activation.py``; split-K works unchanged.
#   * gemv_silu_mul: the same activation as the EPILOGUE of gate_up_proj (``EPI_SILU_MUL`` in gemv.py): each program
#     streams rows of gate and the same rows of up, so it holds both sums of an output column and stores
#     silu(gate) * up; the GEMV streams exactly the bytes it streams unfused, and the activation's launch and the
#     [M, 2 x intermediate] round trip disappear. Its results equal the GEMV followed by the activation kernel bit
#     for bit. With the norm prologue too (``rmsnorm_gemv(..., silu_mul=True)``) the whole post-attention block up
#     to down_proj is one launch. On an H100 (Llama-2-7B and 13B) the epilogue was picked at one row and at 2-8
#     rows; the variant with the norm as well tied with the norm kernel before it.
#
# Which configuration runs, and whether fusing pays at all for a shape, is measured on the running device the first
# time a shape is seen, like ``gemv.linear``: each fused candidate against the unfused pair (the elementwise kernel
# followed by the GEMV ``gemv.linear`` picks), replayed from CUDA graphs over weight copies larger than the L2.
# Measured on an H100 (Llama-2-7B shapes, ``python -m rooflm.kernels.bench_fused``), which sets the defaults:
#   * one row: add + RMSNorm + qkv_proj one-pass 37.0-37.2 us against 38.0-38.3 us unfused (norm 1.9 + GEMV 35.4);
#     the two-pass variant 39.0 us (its serial pass over the row delays the weight stream); before gate_up_proj
#     fused and unfused tie (63.2-63.5 us); SiLU-and-mul + down_proj fused 36.4-36.6 us against 36.0-36.4 us
#     unfused (whose best GEMV for that shape uses tl.dot and split-K). So "auto" times the one-pass norm variants
#     against the unfused pair, and keeps the SiLU pair unfused without timing;
#   * 2 to 16 rows: the flat-GEMM (tl.dot) variants with a prologue ran 1.3-1.4x (norm) and 4x (SiLU) slower than
#     the unfused pair, as every column block recomputes the prologue on 16-row tiles: never fused by default.
# ``ROOFLM_FUSED_GEMV=off`` keeps the unfused pairs; ``on`` takes the fastest fused candidate of every one-row shape
# (both norm variants, and the SiLU fusion) without the comparison. Every variant stays callable directly.
from __future__ import annotations

import os

import torch

from rooflm.kernels._utils import interpreting
from rooflm.kernels.gemv import (
    CANDIDATES, EPI_NONE, EPI_SILU_MUL, MAX_M, PRO_NONE, PRO_RMSNORM, PRO_RMSNORM_ONE_PASS, PRO_SILU_MUL, GemvConfig,
    _short, check_weight, launch_gemv, time_in_graph, weight_copies,
)


def _rows(name: str, x: torch.Tensor, width: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, {width}] and contiguous in its last dim; got {tuple(x.shape)} "
                         f"(strides {x.stride()})")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"{name} has {x.shape[0]} rows; the fused GEMV takes 1 to {MAX_M}")
    return x


def rmsnorm_gemv(
    x: torch.Tensor,  # [M, K], M <= 16
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N] or None
    cfg: GemvConfig,
    residual: torch.Tensor | None = None,  # [M, K]
    one_pass: bool = False,
    silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T + bias, x + residual) in one launch (plus the split-K reduction when
    cfg splits K). Without residual: (rms_norm(x) @ weight.T + bias, x). ``one_pass``: the single-pass variant (see
    the top of this file), for one row and a GEMV configuration without tl.dot or split-K. ``silu_mul``: weight is
    [gate | up] and the first result is silu(gate) * up of the product (the epilogue; one K split)."""
    K = x.shape[-1] if x.dim() == 2 else -1
    _rows("x", x, K)
    if residual is not None:
        _rows("residual", residual, K)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if norm_weight.shape != (K,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} does not match hidden size {K}")
    check_weight(weight, K, x.shape)
    if not cfg.supports(x.shape[0]):
        raise ValueError(f"{cfg} does not support M={x.shape[0]}")
    if one_pass and (cfg.use_dot or cfg.split_k != 1 or x.shape[0] != 1):
        raise ValueError(f"one_pass needs one row and a configuration without tl.dot or split-K; got {cfg}, "
                         f"M={x.shape[0]}")
    res_out = torch.empty_like(x) if residual is not None else None
    out = launch_gemv(x, K, weight, bias, cfg, PRO_RMSNORM_ONE_PASS if one_pass else PRO_RMSNORM, residual,
                      norm_weight.contiguous(), eps, res_out, epilogue=EPI_SILU_MUL if silu_mul else EPI_NONE)
    return out, (res_out if res_out is not None else x)


def gemv_silu_mul(
    x: torch.Tensor,  # [M, K], M <= 16
    weight: torch.Tensor,  # [2 * d, K]: [gate | up] rows
    bias: torch.Tensor | None,  # [2 * d] or None
    cfg: GemvConfig,
) -> torch.Tensor:
    """silu(gate) * up of [gate | up] = x @ weight.T + bias, in one launch (the SiLU-and-mul epilogue): [M, d]."""
    K = x.shape[-1] if x.dim() == 2 else -1
    _rows("x", x, K)
    check_weight(weight, K, x.shape)
    if not cfg.supports(x.shape[0]):
        raise ValueError(f"{cfg} does not support M={x.shape[0]}")
    return launch_gemv(x, K, weight, bias, cfg, PRO_NONE, epilogue=EPI_SILU_MUL)


def silu_mul_gemv(
    gate_up: torch.Tensor,  # [M, 2 * d], M <= 16
    weight: torch.Tensor,  # [N, d]
    bias: torch.Tensor | None,
    cfg: GemvConfig,
) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T + bias for a [gate | up] row, in one launch (plus the split-K reduction)."""
    width = gate_up.shape[-1] if gate_up.dim() == 2 else -1
    if width % 2:
        raise ValueError(f"gate_up needs an even last dimension ([gate | up]); got {tuple(gate_up.shape)}")
    _rows("gate_up", gate_up, width)
    d = width // 2
    check_weight(weight, d, (gate_up.shape[0], d))
    if not cfg.supports(gate_up.shape[0]):
        raise ValueError(f"{cfg} does not support M={gate_up.shape[0]}")
    return launch_gemv(gate_up, d, weight, bias, cfg, PRO_SILU_MUL, up_offset=d)


def rmsnorm_gemv_ref(x, norm_weight, eps, weight, bias=None, residual=None):
    """The twin: the unfused reference norm (``rms_norm_ref``), then torch's linear."""
    from rooflm.kernels.rmsnorm import rms_norm_ref

    if residual is None:
        return torch.nn.functional.linear(rms_norm_ref(x, norm_weight, eps), weight, bias), x
    h, res = rms_norm_ref(x, norm_weight, eps, residual)
    return torch.nn.functional.linear(h, weight, bias), res


def gemv_silu_mul_ref(x, weight, bias=None):
    """The twin: torch's linear, then the unfused activation's reference."""
    from rooflm.kernels.activation import silu_and_mul_ref

    return silu_and_mul_ref(torch.nn.functional.linear(x, weight, bias))


def silu_mul_gemv_ref(gate_up, weight, bias=None):
    from rooflm.kernels.activation import silu_and_mul_ref

    return torch.nn.functional.linear(silu_and_mul_ref(gate_up), weight, bias)


# ---------------------------------------------------------------------------------------------------------------------
# Measure and pick: a fused configuration, or None for the unfused pair
# ---------------------------------------------------------------------------------------------------------------------
_choices: dict[tuple, object] = {}
# CPU tests under the interpreter: small tiles, no timing; (configuration, one_pass) for the norm
INTERPRETER_PICKS = {("rmsnorm", False): (GemvConfig(False, 16, 64), True),
                     ("rmsnorm", True): (GemvConfig(True, 16, 64), False),
                     ("silu_mul", False): GemvConfig(False, 16, 64), ("silu_mul", True): GemvConfig(True, 16, 64),
                     ("gemv_silu_mul", False): GemvConfig(False, 16, 64),
                     ("gemv_silu_mul", True): GemvConfig(True, 16, 64),
                     ("rmsnorm_silu_mul", False): (GemvConfig(False, 16, 64), True),
                     ("rmsnorm_silu_mul", True): (GemvConfig(True, 16, 64), False)}
FUSED_MAX_M = 1  # see the top of this file: above one row the unfused pair was faster


def fused_gemv_mode() -> str:
    """``ROOFLM_FUSED_GEMV``: "auto" (default: fuse where measured faster), "on" (always fuse) or "off"."""
    mode = os.environ.get("ROOFLM_FUSED_GEMV", "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"ROOFLM_FUSED_GEMV={mode!r} is invalid: expected auto, on or off")
    return mode


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_M and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(-1) == 1 and x.stride(-1) == 1
            and (x.is_cuda or interpreting()))


def _pick(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, variants, make_calls,
          max_m: int = FUSED_MAX_M):
    """The fastest of the unfused pair (None) and every fused variant for this shape (cached). ``variants(mode)``:
    the fused candidates for ``fused_gemv_mode()`` (each run by ``fused(variant, xs, w)``); ``make_calls()`` returns
    (fused, unfused), called only when a shape is timed; ``unfused(xs, w)`` runs the pair on ``xs`` (random rows like
    x) with weight ``w``. Variants and calls are built only when a shape is first seen."""
    if not _eligible(x, weight):
        return None
    M = x.shape[0]
    if interpreting():
        return INTERPRETER_PICKS[(kind, M > 1)]
    if M > max_m:
        return None
    key = (kind, M, weight.shape[0], weight.shape[1], x.dtype, bias is not None, x.device)
    if key in _choices:
        return _choices[key]
    if torch.cuda.is_current_stream_capturing():
        return None  # no timing inside a capture; the runner warms up every bucket eagerly first
    mode = fused_gemv_mode()
    candidates = variants(mode)
    if mode == "off" or os.environ.get("ROOFLM_GEMV", "auto") == "off" or not candidates:
        _choices[key] = None
        return None
    fused, unfused = make_calls()
    xs = torch.randn(M, x.shape[1], dtype=x.dtype, device=x.device)
    copies = weight_copies(weight)
    results: list[tuple[float, object]] = []
    if mode == "auto":
        results.append((time_in_graph(lambda w: unfused(xs, w), copies, x.device), None))
    for v in candidates:
        results.append((time_in_graph(lambda w, v=v: fused(v, xs, w), copies, x.device), v))
    del copies
    results.sort(key=lambda r: r[0])
    pick = results[0][1]
    if os.environ.get("ROOFLM_GEMV", "auto") == "verbose":
        print(f"[rooflm.fused_gemv] {kind} M={M} N={weight.shape[0]} K={weight.shape[1]}: "
              + ", ".join(f"{_name(c)}={t * 1e3:.1f}us" for t, c in results))
    _choices[key] = pick
    return pick


def _name(v) -> str:
    if v is None:
        return "unfused"
    if isinstance(v, tuple):
        return _short(v[0]) + ("-1pass" if v[1] else "-2pass")
    return _short(v)


def _row_configs() -> list[GemvConfig]:
    return [c for c in CANDIDATES if not c.use_dot and c.split_k == 1]


def pick_rmsnorm_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      eps: float = 1e-6) -> tuple[GemvConfig, bool] | None:
    """(configuration, one_pass) to run ``rmsnorm_gemv`` with for rows like x ([M, K]), or None where the unfused
    norm + GEMV is faster or the inputs do not suit the kernel (not CUDA, more rows than fused, another dtype)."""

    def make_calls():
        from rooflm.kernels.gemv import linear
        from rooflm.kernels.rmsnorm import rms_norm

        nw = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        res = torch.randn(MAX_M, x.shape[-1], dtype=x.dtype, device=x.device)

        def fused(v, xs, w):
            return rmsnorm_gemv(xs, nw, eps, w, bias, v[0], res[: xs.shape[0]], one_pass=v[1])

        def unfused(xs, w):
            h, _ = rms_norm(xs, nw, eps, res[: xs.shape[0]])
            return linear(h, w, bias)

        return fused, unfused

    if x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        return None
    def variants(mode: str) -> list[tuple[GemvConfig, bool]]:  # the two-pass variant never won by default
        return [(c, one_pass) for c in _row_configs() for one_pass in ((True, False) if mode == "on" else (True,))]

    return _pick("rmsnorm", x, weight, bias, variants, make_calls)


def pick_silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> GemvConfig | None:
    """Like ``pick_rmsnorm_gemv`` for ``silu_mul_gemv`` on [gate | up] rows: a configuration or None (always None
    on CUDA unless ``ROOFLM_FUSED_GEMV=on``: the fusion did not pay, see the top of this file)."""

    def make_calls():
        from rooflm.kernels.activation import silu_and_mul
        from rooflm.kernels.gemv import linear

        def fused(cfg, xs, w):
            return silu_mul_gemv(xs, w, bias, cfg)

        def unfused(xs, w):
            return linear(silu_and_mul(xs), w, bias)

        return fused, unfused

    if gate_up.dim() != 2 or weight.dim() != 2 or gate_up.shape[-1] != 2 * weight.shape[-1]:
        return None
    def variants(mode: str) -> list[GemvConfig]:  # did not pay by default (see the top of this file)
        return _row_configs() if mode == "on" else []

    return _pick("silu_mul", gate_up, weight, bias, variants, make_calls)


def pick_gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> GemvConfig | None:
    """The configuration to run ``gemv_silu_mul`` with for rows like x ([M, K], M <= 16) and a [gate | up] weight,
    or None where the GEMV followed by the activation kernel is faster (or the inputs do not suit the kernel).
    Unlike the prologue fusions this one costs the GEMV nothing (it streams the same rows, paired differently), so
    it is timed at every row count up to 16."""

    def make_calls():
        from rooflm.kernels.activation import silu_and_mul
        from rooflm.kernels.gemv import linear

        def fused(cfg, xs, w):
            return gemv_silu_mul(xs, w, bias, cfg)

        def unfused(xs, w):
            return silu_and_mul(linear(xs, w, bias))

        return fused, unfused

    if x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1] or weight.shape[0] % 2:
        return None

    def variants(mode: str) -> list[GemvConfig]:
        return [c for c in CANDIDATES if c.split_k == 1 and c.supports(x.shape[0])]

    return _pick("gemv_silu_mul", x, weight, bias, variants, make_calls, max_m=MAX_M)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up of x @ weight.T + bias through whatever ``pick_gemv_silu_mul`` chose (its unfused pair where
    it chose none)."""
    cfg = pick_gemv_silu_mul(x, weight, bias)
    if cfg is not None:
        return gemv_silu_mul(x, weight, bias, cfg)
    from rooflm.kernels.activation import silu_and_mul
    from rooflm.kernels.gemv import linear

    return silu_and_mul(linear(x, weight, bias))


def pick_rmsnorm_gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               eps: float = 1e-6) -> tuple[GemvConfig, bool] | None:
    """(configuration, one_pass) for ``rmsnorm_gemv(..., silu_mul=True)`` on rows like x and a [gate | up] weight:
    add + RMSNorm, the projection and SiLU-and-mul in one launch; None where the norm kernel followed by
    ``linear_silu_mul`` is faster."""

    def make_calls():
        from rooflm.kernels.rmsnorm import rms_norm

        nw = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        res = torch.randn(MAX_M, x.shape[-1], dtype=x.dtype, device=x.device)

        def fused(v, xs, w):
            return rmsnorm_gemv(xs, nw, eps, w, bias, v[0], res[: xs.shape[0]], one_pass=v[1], silu_mul=True)

        def unfused(xs, w):
            h, _ = rms_norm(xs, nw, eps, res[: xs.shape[0]])
            return linear_silu_mul(h, w, bias)

        return fused, unfused

    if x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1] or weight.shape[0] % 2:
        return None

    def variants(mode: str) -> list[tuple[GemvConfig, bool]]:
        return [(c, True) for c in _row_configs()]

    return _pick("rmsnorm_silu_mul", x, weight, bias, variants, make_calls)


def choices() -> dict[tuple, object]:
    """What was picked so far, for reports: {(kind, M, N, K, dtype, has_bias, device): the pick, None = unfused}."""
    return dict(_choices)
