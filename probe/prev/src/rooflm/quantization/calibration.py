"""Calibration for GPTQ and AWQ: run the float model on a calibration text and record what each projection sees.

The default text is an excerpt of the King James Bible (1611, public domain; Ecclesiastes), shipped as
``data/calibration_kjv.txt``. It is cut into ``num_samples`` windows of ``seq_len`` tokens, each run as one prefill
through the model with forward pre-hooks on every ``Linear`` of the decoder layers. Per layer, ``LinearStats``
keeps only what the algorithms need: GPTQ's Hessian 2 X^T X / n, AWQ's mean |x| per input channel and a bounded
random subsample of input rows for AWQ's loss.

``collect_stats`` takes all statistics from the float model in one pass: what AWQ uses, and GPTQ with
``sequential=False``. GPTQ as published (Frantar et al. 2023) quantizes layer by layer and feeds each layer the
outputs of the already quantized ones, so that each layer's Hessian describes the inputs it will see in the quantized
model; that is ``rooflm.quantization.sequential`` (``--sequential``), at the cost of several passes of each layer. It
is not GPTQ's default because on the default model it was slightly worse with act-order (docs/quantization.md).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from rooflm.quantization.gptq import HessianAccumulator

CALIBRATION_FILE = os.path.join(os.path.dirname(__file__), "data", "calibration_kjv.txt")


def read_calibration_text(path: str | None = None) -> str:
    """The calibration text: ``path``, or the shipped King James excerpt."""
    path = path or CALIBRATION_FILE
    if not os.path.isfile(path):
        raise FileNotFoundError(f"calibration file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"calibration file {path} is empty")
    return text


def calibration_windows(token_ids: Sequence[int], num_samples: int, seq_len: int) -> list[list[int]]:
    """``num_samples`` windows of ``seq_len`` tokens spread evenly over the text (overlapping when the text is
    shorter than num_samples * seq_len). ValueError if the text is shorter than one window."""
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be at least 1")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1")
    n = len(token_ids)
    if n < seq_len:
        raise ValueError(f"the calibration text has {n} tokens, fewer than seq_len={seq_len}")
    last = n - seq_len
    starts = [round(i * last / max(1, num_samples - 1)) for i in range(num_samples)] if num_samples > 1 else [0]
    return [list(token_ids[s:s + seq_len]) for s in starts]


def tokenize_calibration(text: str, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of the text with the model's tokenizer; without one (random-weight configs), its UTF-8 bytes
    folded into the vocabulary."""
    if tokenizer is None:
        return [b % vocab_size for b in text.encode("utf-8")]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [i for i in ids if i < vocab_size]


@dataclass
class LinearStats:
    """What one projection saw during calibration."""

    in_features: int
    hessian: HessianAccumulator | None = None
    abs_sum: torch.Tensor | None = None
    tokens: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)

    def add(self, x: torch.Tensor, rows_per_call: int, gen: torch.Generator | None) -> None:
        x = x.detach().reshape(-1, self.in_features).float()
        if self.hessian is not None:
            self.hessian.add(x)
        if self.abs_sum is None:
            self.abs_sum = torch.zeros(self.in_features)
        self.abs_sum += x.abs().sum(0).cpu()
        self.tokens += x.shape[0]
        if rows_per_call > 0:
            keep = torch.randperm(x.shape[0], generator=gen)[:rows_per_call] if x.shape[0] > rows_per_call else None
            self.rows.append((x if keep is None else x[keep]).cpu())

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(1, self.tokens)

    def samples(self) -> torch.Tensor:
        return torch.cat(self.rows) if self.rows else torch.zeros(0, self.in_features)


def decoder_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Every ``rooflm.layers.linear.Linear`` inside the decoder layers, by module name (embeddings and the LM head
    stay in float, as in published GPTQ and AWQ checkpoints)."""
    from rooflm.layers.linear import Linear

    return {name: m for name, m in model.named_modules() if isinstance(m, Linear) and ".layers." in f".{name}"}


@torch.no_grad()
def collect_stats(model: nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                  windows: list[list[int]], hessian: bool, rows_per_window: int = 0,
                  seed: int = 0) -> dict[str, LinearStats]:
    """Run each window as one prefill and record every decoder Linear's inputs (see module docstring)."""
    from rooflm.attention.metadata_utils import allocate_kv_caches, single_sequence_metadata

    linears = decoder_linears(model)
    stats = {name: LinearStats(m.in_features, HessianAccumulator(m.in_features) if hessian else None)
             for name, m in linears.items()}
    gen = torch.Generator().manual_seed(seed)
    handles = []
    for name, m in linears.items():
        def hook(_mod, args, _name=name):
            stats[_name].add(args[0], rows_per_window, gen)

        handles.append(m.register_forward_pre_hook(hook))
    param = next(model.parameters())
    block_size = 16
    try:
        for ids in windows:
            blocks = (len(ids) + block_size - 1) // block_size
            caches = allocate_kv_caches(num_layers, blocks, block_size, num_kv_heads, head_dim, dtype=param.dtype,
                                        device=param.device)
            meta, positions = single_sequence_metadata(0, len(ids), block_size, device=param.device)
            model(torch.tensor(ids, device=param.device), positions, caches, meta)
    finally:
        for h in handles:
            h.remove()
    return stats
