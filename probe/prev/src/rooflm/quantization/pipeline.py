"""Quantize a loaded rooflm model with round-to-nearest, GPTQ or AWQ, into Hugging Face-named pieces ready to be
written as a GPTQ or AWQ checkpoint (``rooflm.quantization.checkpoint``).

rooflm fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``. The algorithms run on the fused projections
(quantization groups run along the input dimension and GPTQ treats output rows independently, so a fused matrix
quantizes exactly as its parts would) and the result is split back into the Hugging Face modules by the row ranges
the model's ``weight_targets`` name. Dense models only: mixture-of-experts models are refused.

GPTQ takes every Hessian from the float model in one pass (``collect_stats``) by default, leaving the model as it
was. ``QuantizeConfig.sequential`` calibrates as the paper does instead (``rooflm.quantization.sequential``): layer
by layer, each projection's Hessian from the inputs the already quantized projections produce; the model's
projections then hold their dequantized weights. On the default model sequential was better without act-order and
slightly worse with it, the best setting (docs/quantization.md), so it is not the default.

AWQ folds 1/s into the operation before each projection (Lin et al. 2024): the RMSNorm weight before qkv_proj and
gate_up_proj; the ``up`` rows of gate_up_proj before down_proj (act(gate) * up / s is exact); the ``v`` rows of
qkv_proj before o_proj only when every query head has its own value head (with grouped-query attention one v row
feeds several heads' o_proj columns, so o_proj keeps s = 1, i.e. plain round-to-nearest). Projections with nothing
to fold into are not scaled. The clipping search then runs
on every projection but qkv_proj (AWQ leaves q and k unclipped).
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from rooflm.config import ModelConfig
from rooflm.quantization.awq import awq_quantize, search_scales
from rooflm.quantization.calibration import collect_stats, decoder_linears
from rooflm.quantization.formats import IntQuant
from rooflm.quantization.gptq import gptq_quantize
from rooflm.quantization.sequential import sequential_gptq
from rooflm.quantization.zeropoint import quantize_int

logger = logging.getLogger(__name__)

METHODS = ("rtn", "gptq", "awq")
# GPTQ's calibration when not chosen: one pass of the float model. Sequential calibration measured slightly worse
# on the default model with act-order, the best 4-bit setting (23.41 against 23.30, docs/quantization.md)
SEQUENTIAL_DEFAULT = False


@dataclass
class QuantizeConfig:
    method: str = "gptq"
    bits: int = 4
    group_size: int | None = None  # None: 128 where it divides every projection's in_features; -1: per channel
    desc_act: bool = False  # GPTQ act-order
    percdamp: float = 0.01  # GPTQ dampening, a fraction of mean(diag H)
    num_samples: int = 16  # calibration windows
    seq_len: int = 256  # tokens per window
    min_zero: int = 0  # 1 for GPTQ's classic checkpoint format (it stores z - 1)
    awq_rows: int = 1024  # input rows per projection kept for AWQ's loss
    awq_clip: bool = True  # AWQ's per-group clipping search
    # RTN and GPTQ: each group's scale and zero point searched for the smallest squared error (``search_group_params``)
    # instead of taken from the group's min and max. Not for AWQ, whose clipping search already chooses the range
    # (measured on the default model: no better, three times slower)
    search_grid: bool = True
    # GPTQ: layer by layer from the quantized layers' outputs (Frantar et al. 2023; ``rooflm.quantization.sequential``)
    # instead of every Hessian from the float model in one pass. None: the method's default (``SEQUENTIAL_DEFAULT``
    # for GPTQ; the other methods take no such option)
    sequential: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is invalid: expected one of {METHODS}")
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits} is not supported: expected 4 or 8")
        if self.group_size is not None and self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} is invalid: expected a positive integer or -1")
        if self.desc_act and self.method != "gptq":
            raise ValueError(f"desc_act=True is GPTQ's act-order: it does not apply to method={self.method!r}")
        if self.sequential and self.method != "gptq":
            raise ValueError(f"sequential=True is GPTQ's sequential calibration: it does not apply to "
                             f"method={self.method!r}")
        if self.sequential is None:
            self.sequential = self.method == "gptq" and SEQUENTIAL_DEFAULT
        if not 0 < self.percdamp < 1:
            raise ValueError(f"percdamp={self.percdamp} must lie in (0, 1)")
        if self.min_zero not in (0, 1):
            raise ValueError(f"min_zero={self.min_zero} is invalid: expected 0 or 1")
        for name in ("num_samples", "seq_len", "awq_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")

    @property
    def needs_calibration(self) -> bool:
        return self.method != "rtn"


@dataclass
class QuantizedModel:
    """HF module name -> its quantized weight, and every other HF tensor in float (AWQ's folded norms included)."""

    quantized: dict[str, IntQuant]
    float_state: dict[str, torch.Tensor]
    group_size: int  # -1: one group per output channel
    alphas: dict[str, float] = field(default_factory=dict)  # AWQ: the chosen alpha per projection


def resolve_group_size(group_size: int | None, in_features: dict[str, int]) -> int:
    """The group size to use: ``group_size`` checked against every projection, or (None) 128 when it divides every
    in_features, else the largest power of two up to 128 that does."""
    if group_size == -1:
        return -1
    if group_size is None:
        common = math.gcd(*in_features.values()) if in_features else 128
        group_size = 128
        while common % group_size:
            group_size //= 2
        return group_size
    for name, k in in_features.items():
        if k % group_size:
            raise ValueError(f"group_size={group_size} does not divide in_features={k} of {name}: choose a divisor of "
                             f"{math.gcd(*in_features.values())} or -1 (per channel)")
    return group_size


def _hf_shards(model: nn.Module, linears: dict[str, nn.Module]) -> dict[str, tuple[str, slice]]:
    """HF module name (``...q_proj``) -> (rooflm Linear name, its row range)."""
    owner = {id(m.weight): name for name, m in linears.items()}
    shards: dict[str, tuple[str, slice]] = {}
    for hf_name, target in model.weight_targets().items():
        if hf_name.endswith(".weight") and id(target.param) in owner:
            rows = target.index[0] if target.index else slice(None)
            shards[hf_name[: -len(".weight")]] = (owner[id(target.param)], rows)
    return shards


def _awq_folds(model: nn.Module, cfg: ModelConfig) -> dict[str, Callable[[torch.Tensor], None]]:
    """Linear name -> a function dividing the operation before it by s (see module docstring)."""
    def divide_vector(vec: torch.Tensor) -> Callable[[torch.Tensor], None]:
        return lambda s: vec.div_(s.to(vec.dtype))

    def divide_rows(lin: nn.Module, rows: slice) -> Callable[[torch.Tensor], None]:
        def fold(s: torch.Tensor) -> None:
            lin.weight.data[rows].div_(s.to(lin.weight.dtype).unsqueeze(1))
            if lin.bias is not None:
                lin.bias.data[rows].div_(s.to(lin.bias.dtype))
        return fold

    folds: dict[str, Callable[[torch.Tensor], None]] = {}
    for i, layer in enumerate(getattr(model.model, "layers", [])):
        p = f"model.layers.{i}"
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "qkv_proj"):
            folds[f"{p}.self_attn.qkv_proj"] = divide_vector(layer.input_layernorm.weight.data)
            if cfg.num_attention_heads == cfg.num_key_value_heads:
                v = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
                folds[f"{p}.self_attn.o_proj"] = divide_rows(attn.qkv_proj, v)
        mlp = getattr(layer, "mlp", None)
        if getattr(layer, "mlp_norm_gate_up", None) is not None:
            folds[f"{p}.mlp.gate_up_proj"] = divide_vector(layer.post_attention_layernorm.weight.data)
        if mlp is not None and hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):
            n = mlp.intermediate_size
            folds[f"{p}.mlp.down_proj"] = divide_rows(mlp.gate_up_proj, slice(n, 2 * n))
    return folds


@torch.no_grad()
def quantize_model(model: nn.Module, cfg: ModelConfig, qcfg: QuantizeConfig,
                   windows: list[list[int]] | None = None) -> QuantizedModel:
    """Quantize every decoder projection of ``model`` (modified in place by AWQ's folding, and by sequential GPTQ,
    which leaves the dequantized weights in the projections). ``windows``: the calibration token windows (GPTQ and
    AWQ)."""
    if cfg.is_moe:
        # the experts are stacked tensors, not Linear layers: a checkpoint with float experts beside quantized
        # attention would not load as GPTQ / AWQ elsewhere
        raise ValueError(f"model {cfg.architecture} is a mixture of experts (num_local_experts="
                         f"{cfg.num_local_experts}): quantizing its experts is not supported")
    linears = decoder_linears(model)
    if not linears:
        raise ValueError(f"model {cfg.architecture} has no Linear projections to quantize")
    group = resolve_group_size(qcfg.group_size, {n: m.in_features for n, m in linears.items()})
    stats = {}
    if qcfg.needs_calibration and not windows:
        raise ValueError(f"method={qcfg.method!r} needs calibration windows")
    if qcfg.method == "gptq" and qcfg.sequential:
        start = time.perf_counter()
        done = sequential_gptq(model, cfg.num_key_value_heads, cfg.head_dim, windows,
                               lambda w, h: _gptq(w, h, qcfg, group))
        logger.info("sequential GPTQ on %d windows of %d tokens in %.1f s", len(windows), len(windows[0]),
                    time.perf_counter() - start)
        return _result(model, linears, done, group, {})
    if qcfg.needs_calibration:
        rows = max(1, qcfg.awq_rows // len(windows)) if qcfg.method == "awq" else 0
        start = time.perf_counter()
        stats = collect_stats(model, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, windows,
                              hessian=qcfg.method == "gptq", rows_per_window=rows, seed=qcfg.seed)
        logger.info("calibrated on %d windows of %d tokens in %.1f s", len(windows), len(windows[0]),
                    time.perf_counter() - start)

    fused: dict[str, IntQuant] = {}
    alphas: dict[str, float] = {}
    if qcfg.method == "awq":
        folds = _awq_folds(model, cfg)
        scales = {}
        for i, (name, m) in enumerate(linears.items()):
            g = m.in_features if group == -1 else group
            _progress(i, len(linears), "AWQ scale search")
            if name in folds:
                st = stats[name]
                res = search_scales(m.weight.data, st.samples(), st.abs_mean, qcfg.bits, g, min_zero=qcfg.min_zero)
                scales[name], alphas[name] = res.scales, res.alpha
        for name, s in scales.items():  # fold only after every search saw the float weights
            folds[name](s)
        for name, m in linears.items():
            g = m.in_features if group == -1 else group
            s = scales.get(name, torch.ones(m.in_features))
            # AWQ does not clip q/k (their error is amplified by the attention softmax): no clipping for qkv_proj
            x = stats[name].samples() if qcfg.awq_clip and not name.endswith("qkv_proj") else None
            fused[name] = awq_quantize(m.weight.data, s, qcfg.bits, g, qcfg.min_zero, x)
            m.weight.data.mul_(s.to(m.weight.dtype))  # the float model stays equivalent to the quantized one
    else:
        for i, (name, m) in enumerate(linears.items()):
            g = m.in_features if group == -1 else group
            _progress(i, len(linears), qcfg.method.upper())
            if qcfg.method == "gptq":
                fused[name] = _gptq(m.weight.data, stats[name].hessian.hessian(), qcfg, group)
            else:
                fused[name] = quantize_int(m.weight.data, qcfg.bits, g, qcfg.min_zero, search=qcfg.search_grid)
    return _result(model, linears, fused, group, alphas)


def _gptq(w: torch.Tensor, hessian: torch.Tensor, qcfg: QuantizeConfig, group: int) -> IntQuant:
    """``gptq_quantize`` with the config's options (group -1: one group per output channel)."""
    return gptq_quantize(w, hessian, qcfg.bits, w.shape[1] if group == -1 else group, desc_act=qcfg.desc_act,
                         percdamp=qcfg.percdamp, min_zero=qcfg.min_zero, search_grid=qcfg.search_grid)


def _result(model: nn.Module, linears: dict[str, nn.Module], fused: dict[str, IntQuant], group: int,
            alphas: dict[str, float]) -> QuantizedModel:
    """The fused projections split into their HF modules, and every other HF tensor of the model in float."""
    shards = _hf_shards(model, linears)
    quantized = {hf: slice_rows(fused[lin], rows) for hf, (lin, rows) in shards.items()}
    quantized_weights = {f"{hf}.weight" for hf in quantized}
    float_state = {name: t.view().detach().clone() for name, t in model.weight_targets().items()
                   if name not in quantized_weights}
    return QuantizedModel(quantized=quantized, float_state=float_state, group_size=group, alphas=alphas)


def _progress(i: int, total: int, what: str) -> None:
    step = max(1, total // 10)
    if i % step == 0:
        logger.info("%s: projection %d of %d", what, i + 1, total)


def slice_rows(q: IntQuant, rows: slice) -> IntQuant:
    """Output rows ``rows`` of a quantized weight (one shard of a fused projection)."""
    return IntQuant(codes=q.codes[rows].contiguous(), scales=q.scales[rows].contiguous(),
                    zeros=q.zeros[rows].contiguous(), bits=q.bits, group_size=q.group_size, g_idx=q.g_idx)
