"""Declarative weight loading shared by the models.

A model lists, for every Hugging Face tensor name it expects, the parameter that receives it and where inside that
parameter it goes (an index: the whole parameter, a row range of a fused projection, an expert's slice...).
``load_named_weights`` streams (name, tensor) pairs into those places and then checks that every expected tensor came.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that no rooflm model needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class WeightTarget:
    param: nn.Parameter
    index: tuple = ()  # where in ``param`` the checkpoint tensor goes; () is the whole parameter

    def view(self) -> torch.Tensor:
        return self.param.data[self.index] if self.index else self.param.data


def rows(start: int, size: int) -> tuple:
    """Index of rows [start, start + size) along dim 0 (one shard of a fused projection)."""
    return (slice(start, start + size),)


def load_named_weights(
    targets: dict[str, WeightTarget],
    weights: Iterable[tuple[str, torch.Tensor]],
    optional: Iterable[str] = (),
) -> set[str]:
    """Copy each checkpoint tensor into its target (casting to the parameter's dtype and device).

    Raises ValueError naming the tensor on a shape mismatch, and naming the missing tensors when the stream ends
    without them. Tensors named in ``optional`` (e.g. a tied ``lm_head.weight``) are skipped when present. Returns the
    names loaded."""
    optional = set(optional)
    loaded: set[str] = set()
    for name, tensor in weights:
        target = targets.get(name)
        if target is None:
            if name not in optional and not name.endswith(IGNORED_SUFFIXES):
                logger.warning("ignoring checkpoint tensor %s: the model has no place for it", name)
            continue
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
    return loaded
