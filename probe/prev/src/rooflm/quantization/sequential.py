"""Sequential GPTQ calibration, as published (Frantar et al. 2023, section 4 and Algorithm 1's outer loop): the
decoder is quantized one layer at a time, and each layer's Hessians come from the inputs that the already quantized
layers before it produce, so GPTQ also corrects the error those layers passed on instead of fitting float inputs
the quantized model will never see. Chosen with ``QuantizeConfig.sequential`` / ``rooflm quantize --sequential``;
one pass of the float model stays the default, since on the default model sequential calibration came out slightly
worse with act-order and better without it (docs/quantization.md).

Inside a layer the projections go in the order data flows through them ("true sequential", as AutoGPTQ and
GPTQModel do): ``qkv_proj``; then ``o_proj`` with inputs computed through the quantized qkv; then ``gate_up_proj``;
then ``down_proj``. After each step the float weight in the model is replaced by its dequantized value, and once the
whole layer is quantized it runs once more to give the next layer its inputs. The model therefore ends with the
dequantized weights in its projections (what the written checkpoint computes).

The layers are called one by one, as ``LlamaModel.forward`` does (embeddings, rotary cos / sin, then each
``LlamaDecoderLayer`` with its residual stream), on each calibration window as one prefill; the (hidden, residual)
pair entering the current layer is kept per window. Running a layer only as far as the projection being calibrated
(a pre-hook stops it there) saves most of the repeated passes: the layer's inputs for qkv_proj, its attention for
o_proj, and so on.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from rooflm.quantization.formats import IntQuant
from rooflm.quantization.gptq import HessianAccumulator

logger = logging.getLogger(__name__)

# the projections of a decoder layer in the order its data flows through them, each group sharing its input
TRUE_SEQUENTIAL = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
BLOCK_SIZE = 16  # tokens per KV-cache block of the calibration prefills

# (float weight [N, K], Hessian [K, K]) -> the quantized weight
QuantizeFn = Callable[[torch.Tensor, torch.Tensor], IntQuant]


class _Stop(Exception):
    """Raised by a pre-hook once the projection being calibrated has seen its input: the rest of the layer would be
    computed for nothing."""


class LayerRunner:
    """Runs the decoder layers of a Llama-family ``model`` one at a time on calibration windows, each window one
    prefill (see module docstring). ``inputs[w]``: the (hidden, residual) pair entering the current layer for window
    w; ``advance`` moves it through the current layer."""

    def __init__(self, model: nn.Module, num_kv_heads: int, head_dim: int, windows: list[list[int]]) -> None:
        from rooflm.attention.metadata_utils import allocate_kv_caches, single_sequence_metadata

        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers")):
            raise ValueError(f"sequential calibration needs a Llama-family model, got {type(model).__name__}")
        if getattr(inner, "pp_size", 1) != 1 or inner.embed_tokens is None:
            raise ValueError("sequential calibration needs the whole model in one process (no pipeline stages)")
        if not windows:
            raise ValueError("sequential calibration needs at least one calibration window")
        self.model = inner
        param = next(model.parameters())
        self.steps = []  # per window: (cos, sin, metadata)
        self.inputs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for ids in windows:
            meta, positions = single_sequence_metadata(0, len(ids), BLOCK_SIZE, device=param.device)
            hidden = inner.embed_tokens(torch.tensor(ids, device=param.device))
            cos, sin = inner.rotary_emb.cos_sin(positions, hidden.dtype)
            self.steps.append((cos, sin, meta))
            self.inputs.append((hidden, None))
        blocks = (max(len(ids) for ids in windows) + BLOCK_SIZE - 1) // BLOCK_SIZE
        # one layer runs at a time, each window from position 0: one layer's cache serves every call
        self.cache = allocate_kv_caches(1, blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=param.dtype,
                                        device=param.device)[0]

    def run(self, index: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index`` on window ``window``'s current inputs: its (hidden, residual) output."""
        hidden, residual = self.inputs[window]
        cos, sin, meta = self.steps[window]
        return self.model.layers[index](hidden, residual, cos, sin, self.cache, meta)

    def collect(self, index: int, linears: dict[str, nn.Module]) -> dict[str, HessianAccumulator]:
        """The GPTQ Hessian of each of ``linears`` (projections of layer ``index``) over every window, running the
        layer only until the last of them has seen its input."""
        acc = {name: HessianAccumulator(m.in_features) for name, m in linears.items()}
        seen: set[str] = set()
        handles = []
        for name, m in linears.items():
            def hook(_mod, args, _name=name):
                acc[_name].add(args[0])
                seen.add(_name)
                if len(seen) == len(acc):
                    raise _Stop

            handles.append(m.register_forward_pre_hook(hook))
        try:
            for w in range(len(self.inputs)):
                seen.clear()
                try:
                    self.run(index, w)
                except _Stop:
                    pass
        finally:
            for h in handles:
                h.remove()
        return acc

    def advance(self, index: int) -> None:
        """Replace every window's inputs by layer ``index``'s outputs."""
        self.inputs = [self.run(index, w) for w in range(len(self.inputs))]

    def final_hidden(self) -> list[torch.Tensor]:
        """The model's output (its final norm over the current inputs) per window: after advancing through every
        layer, what ``model(...)`` returns."""
        return [self.model.norm(h, r)[0] if r is not None else self.model.norm(h) for h, r in self.inputs]


@torch.no_grad()
def sequential_gptq(model: nn.Module, num_kv_heads: int, head_dim: int, windows: list[list[int]],
                    quantize: QuantizeFn) -> dict[str, IntQuant]:
    """Quantize every decoder projection of ``model`` layer by layer and, inside a layer, in ``TRUE_SEQUENTIAL``
    order, each from the Hessian of the inputs the already quantized projections produce (see module docstring).
    ``quantize`` turns a float weight and its Hessian into an ``IntQuant``. Returns the quantized weights by module
    name; the model's projections hold their dequantized values afterwards."""
    from rooflm.quantization.calibration import decoder_linears

    linears = decoder_linears(model)
    runner = LayerRunner(model, num_kv_heads, head_dim, windows)
    layers = runner.model.layers
    known = {f"model.layers.{i}.{p}" for i in range(len(layers)) for p in TRUE_SEQUENTIAL}
    if set(linears) != known:
        other = sorted(set(linears) ^ known)[:4]
        raise ValueError(f"sequential calibration knows the projections {TRUE_SEQUENTIAL} of a Llama decoder layer; "
                         f"this model differs ({', '.join(other)})")
    quantized: dict[str, IntQuant] = {}
    start = time.perf_counter()
    for i in range(len(layers)):
        for proj in TRUE_SEQUENTIAL:
            name = f"model.layers.{i}.{proj}"
            m = linears[name]
            hessian = runner.collect(i, {name: m})[name].hessian()
            quantized[name] = quantize(m.weight.data, hessian)
            # the projections after this one (and the next layers) see what the quantized weight computes
            m.weight.data.copy_(quantized[name].dequantize().to(m.weight.dtype))
        runner.advance(i)
        logger.info("sequential GPTQ: layer %d of %d done (%.1f s)", i + 1, len(layers), time.perf_counter() - start)
    return quantized
