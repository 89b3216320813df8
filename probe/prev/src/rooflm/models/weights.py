"""Declarative weight loading shared by the models.

A model lists, for every Hugging Face tensor name it expects, the parameter that receives it and where inside that
parameter it goes (an index: the whole parameter, a row range of a fused projection, an expert's slice...).
``load_named_weights`` streams (name, tensor) pairs into those places and then checks that every expected tensor came.

A pair may carry a quantized ``PackedWeight`` instead of a tensor (a GPTQ/AWQ checkpoint, a GGUF file kept
quantized). For the weight of a ``Linear`` or an untied ``LMHead``, whole or one row range of a fused projection
(``qkv_proj`` = [q | k | v], ``gate_up_proj`` = [gate | up]), the shards of a layer are collected and, once all of
its rows arrived, stacked (``cat_rows``) and handed to the layer's ``set_packed``. Elsewhere (embeddings, norms,
Mixtral's stacked experts) the packed weight is dequantized and copied like a float tensor.

Under tensor parallelism a target carries a ``Shard`` (``rooflm.distributed.partition``): each checkpoint tensor is
cut to this rank's rows or columns as it streams past, so no rank ever holds the whole model in its parameters.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from rooflm.distributed.partition import Shard, narrow_weight
from rooflm.layers.linear import QuantizableMixin
from rooflm.quantization.packed import PackedWeight, cat_rows, dequantize

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that no rooflm model needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class WeightTarget:
    param: nn.Parameter
    index: tuple = ()  # where in ``param`` the checkpoint tensor goes; () is the whole parameter
    shard: Shard | None = None  # the part of the checkpoint tensor this tensor-parallel rank loads; None: all of it

    def view(self) -> torch.Tensor:
        return self.param.data[self.index] if self.index else self.param.data


def rows(start: int, size: int) -> tuple:
    """Index of rows [start, start + size) along dim 0 (one shard of a fused projection)."""
    return (slice(start, start + size),)


class _PackedShards:
    """Collects the packed shards of each quantizable layer until all of its rows arrived."""

    def __init__(self, model: nn.Module | None) -> None:
        # id(float weight Parameter) -> its layer. A tied LM head is left out: its Parameter is the embedding's, and
        # an embedding lookup needs float values.
        self.owner: dict[int, QuantizableMixin] = {}
        if model is not None:
            for m in model.modules():
                if isinstance(m, QuantizableMixin) and m.weight is not None and not getattr(m, "tied", False):
                    self.owner[id(m.weight)] = m
        self.pending: dict[int, dict[int, PackedWeight]] = {}  # id(layer) -> {first row: shard}
        self.packed: set[int] = set()  # layers that got (some) packed shards
        self.floats: set[int] = set()  # layers that got (some) float tensors

    def layer_of(self, target: WeightTarget) -> QuantizableMixin | None:
        return self.owner.get(id(target.param))

    def add(self, name: str, target: WeightTarget, layer: QuantizableMixin, pw: PackedWeight) -> None:
        if id(layer) in self.floats:
            raise ValueError(f"weight {name!r} is quantized but other shards of the same layer were float: a layer "
                             "must come either all quantized or all float")
        if target.index == ():
            start, size = 0, layer.out_features
        elif len(target.index) == 1 and isinstance(target.index[0], slice) and target.index[0].step is None:
            sl = target.index[0]
            start, size = sl.start or 0, (sl.stop if sl.stop is not None else layer.out_features) - (sl.start or 0)
        else:
            raise ValueError(f"weight {name!r} is quantized but its place {target.index} is not a row range")
        if (pw.out_features, pw.in_features) != (size, layer.in_features):
            raise ValueError(f"weight {name!r} has shape ({pw.out_features}, {pw.in_features}) in the checkpoint, "
                             f"expected ({size}, {layer.in_features}) from the model config")
        shards = self.pending.setdefault(id(layer), {})
        shards[start] = pw
        self.packed.add(id(layer))
        covered = 0
        for first in sorted(shards):
            if first != covered:
                return  # a gap: more shards to come
            covered += shards[first].out_features
        if covered == layer.out_features:
            layer.set_packed(cat_rows([shards[first] for first in sorted(shards)]))
            del self.pending[id(layer)]

    def add_float(self, name: str, layer: QuantizableMixin) -> None:
        if id(layer) in self.packed:
            raise ValueError(f"weight {name!r} is float but other shards of the same layer were quantized: a layer "
                             "must come either all quantized or all float")
        self.floats.add(id(layer))


def load_named_weights(
    targets: dict[str, WeightTarget],
    weights: Iterable[tuple[str, torch.Tensor | PackedWeight]],
    optional: Iterable[str] = (),
    model: nn.Module | None = None,
) -> set[str]:
    """Copy each checkpoint tensor into its target (casting to the parameter's dtype and device).

    A ``PackedWeight`` for the weight of one of ``model``'s quantizable layers (or a row range of one) is kept
    packed (see the module docstring); anywhere else it is dequantized. Raises ValueError naming the tensor on a
    shape mismatch, on a layer that gets both float and quantized shards, and naming the missing tensors when the
    stream ends without them. Tensors named in ``optional`` (e.g. a tied ``lm_head.weight``) are skipped when
    present. Returns the names loaded."""
    optional = set(optional)
    loaded: set[str] = set()
    shards = _PackedShards(model)
    for name, tensor in weights:
        target = targets.get(name)
        if target is None:
            if name not in optional and not name.endswith(IGNORED_SUFFIXES):
                logger.warning("ignoring checkpoint tensor %s: the model has no place for it", name)
            continue
        if target.shard is not None:
            tensor = narrow_weight(tensor, target.shard)
        layer = shards.layer_of(target)
        if isinstance(tensor, PackedWeight):
            if layer is not None:
                shards.add(name, target, layer, tensor)
                loaded.add(name)
                continue
            tensor = dequantize(tensor, dtype=torch.float32)
        elif layer is not None:
            shards.add_float(name, layer)
        dst = target.view()
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)} in the checkpoint, expected {tuple(dst.shape)} "
                "from the model config"
            )
        dst.copy_(tensor)
        loaded.add(name)
    missing = [n for n in targets if n not in loaded]
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"the checkpoint is missing weight tensor(s): {shown}")
    if shards.pending:  # every name came, yet some layer's rows do not tile: overlapping shards
        raise ValueError(f"the quantized shards of {len(shards.pending)} layer(s) do not cover their rows exactly")
    return loaded
