"""Training Medusa-1 heads on a frozen model (Cai et al. 2024, section 2.2.1): only the heads learn; the model's
forward gives the final hidden states h_t, and head i is trained with the cross-entropy of
``lm_head(h_t + SiLU(W_i h_t + b_i))`` against token t + i + 1, through the model's own frozen LM head.

The model is frozen, so each window of training text goes through it once: its hidden states are kept and reused by
later epochs, and a step costs only the heads and the LM head (forward and backward to the heads' outputs). On a CPU
that makes a few thousand distinct positions trained over several epochs affordable in minutes.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from rooflm.spec_decode.medusa import MedusaHeads


@dataclass
class MedusaTrainConfig:
    num_heads: int = 4
    steps: int = 200
    lr: float = 2e-3
    seq_len: int = 256  # tokens per window of text
    batch_size: int = 2  # windows per step
    max_train_tokens: int = 16384  # distinct training positions (their hidden states are computed once)
    eval_tokens: int = 1024  # held-out positions for the accuracy report
    warmup_steps: int = 10
    weight_decay: float = 0.0
    log_every: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_heads", "steps", "seq_len", "batch_size", "max_train_tokens", "eval_tokens", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MedusaTrainConfig.{name}={v!r} is invalid: expected a positive integer")
        if not self.lr > 0:
            raise ValueError(f"MedusaTrainConfig.lr={self.lr!r} is invalid: expected a positive number")
        if self.seq_len <= self.num_heads + 1:
            raise ValueError(f"MedusaTrainConfig.seq_len={self.seq_len} is invalid: it must exceed num_heads + 1 "
                             f"= {self.num_heads + 1} (head i is trained on token t + i + 1)")


def lm_head_matrix(model: nn.Module) -> torch.Tensor:
    """The LM head as a float [vocab, hidden] matrix (a tied head reads the embedding's float copy)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2:
        return weight.detach()
    if getattr(head, "tied", False):
        return model.model.embed_tokens.weight.detach()
    raise ValueError(f"train-medusa needs the LM head of {type(model).__name__} in floating point: load the model "
                     "with quantization='none'")


@torch.inference_mode()
def hidden_states(model: nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                  ids: list[int]) -> torch.Tensor:
    """The final hidden states [T, H] of one sequence (a fresh scratch cache)."""
    from rooflm.attention.metadata_utils import allocate_kv_caches, single_sequence_metadata

    block = 16
    device = next(model.parameters()).device
    caches = allocate_kv_caches(num_layers, -(-len(ids) // block), block, num_kv_heads, head_dim, device=device)
    meta, pos = single_sequence_metadata(0, len(ids), block, device=device)
    return model(torch.tensor(ids, device=device), pos, caches, meta).float().clone()


def head_losses(heads: MedusaHeads, lm_head: torch.Tensor, hidden: torch.Tensor,
                ids: torch.Tensor) -> list[torch.Tensor]:
    """Per head i (1-based), the mean cross-entropy of its prediction at t against ids[t + i + 1]."""
    out = []
    for i in range(1, heads.num_heads + 1):
        h = hidden[:, :-(i + 1)]  # [B, L - i - 1, H]
        x = h + F.silu(h @ heads.weight[i - 1].t() + heads.bias[i - 1])
        logits = x.reshape(-1, x.shape[-1]) @ lm_head.t()
        out.append(F.cross_entropy(logits, ids[:, i + 1:].reshape(-1)))
    return out


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, lm_head: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor) -> list[float]:
    """Top-1 accuracy at offsets 1..k+1: the LM head's own next token, then each head's token t + i + 1."""
    acc = [(((hidden[:, :-1] @ lm_head.t()).argmax(-1)) == ids[:, 1:]).float().mean().item()]
    for i in range(1, heads.num_heads + 1):
        h = hidden[:, :-(i + 1)]
        x = h + F.silu(h @ heads.weight[i - 1].t() + heads.bias[i - 1])
        acc.append(((x @ lm_head.t()).argmax(-1) == ids[:, i + 1:]).float().mean().item())
    return acc


def windows(ids: list[int], seq_len: int, max_tokens: int) -> list[list[int]]:
    n = min(len(ids), max_tokens) // seq_len
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(n)]


def train_medusa(model: nn.Module, cfg, train_ids: list[int], eval_ids: list[int], tc: MedusaTrainConfig,
                 log: Callable[[str], None] = print) -> tuple[MedusaHeads, dict]:
    """Train ``tc.num_heads`` heads on ``train_ids``; report top-1 accuracy on ``eval_ids`` before and after.
    ``cfg``: the model's ModelConfig. Returns the heads and a summary (losses, accuracies, seconds)."""
    torch.manual_seed(tc.seed)
    rng = random.Random(tc.seed)
    train = windows(train_ids, tc.seq_len, tc.max_train_tokens)
    evals = windows(eval_ids, tc.seq_len, max(tc.eval_tokens, tc.seq_len))
    if not train:
        raise ValueError(f"train-medusa: the training text has {len(train_ids)} tokens, fewer than one window of "
                         f"seq_len={tc.seq_len}")
    if not evals:
        raise ValueError(f"train-medusa: the evaluation text has {len(eval_ids)} tokens, fewer than one window of "
                         f"seq_len={tc.seq_len}")
    lm_head = lm_head_matrix(model).float()
    heads = MedusaHeads(tc.num_heads, cfg.hidden_size)
    geometry = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    cache: dict[int, torch.Tensor] = {}  # window -> hidden states: the model is frozen, each window runs once

    def batch(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        for i in idx:
            if i not in cache:
                cache[i] = hidden_states(model, *geometry, train[i])
        return torch.stack([cache[i] for i in idx]), torch.tensor([train[i] for i in idx])

    t0 = time.perf_counter()
    eval_h = torch.stack([hidden_states(model, *geometry, w) for w in evals])
    eval_ids_t = torch.tensor(evals)
    before = head_accuracy(heads, lm_head, eval_h, eval_ids_t)
    opt = torch.optim.AdamW(heads.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    order: list[int] = []
    losses: list[float] = []
    window_loss: list[list[float]] = []
    for step in range(1, tc.steps + 1):
        if len(order) < tc.batch_size:  # a new epoch: every window once, in a new order
            epoch = list(range(len(train)))
            rng.shuffle(epoch)
            order += epoch
        idx, order = order[:tc.batch_size], order[tc.batch_size:]
        hidden, ids = batch(idx)
        scale = min(1.0, step / tc.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / tc.steps)))
        for g in opt.param_groups:
            g["lr"] = tc.lr * scale
        per_head = head_losses(heads, lm_head, hidden, ids)
        loss = torch.stack(per_head).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        window_loss.append([x.item() for x in per_head])
        if step % tc.log_every == 0 or step == tc.steps:
            recent = window_loss[-tc.log_every:]
            means = [sum(col) / len(recent) for col in zip(*recent)]
            log(f"step {step}/{tc.steps}: loss {sum(means) / len(means):.3f} (heads: "
                f"{' '.join(f'{m:.2f}' for m in means)}), lr {tc.lr * scale:.2e}, {time.perf_counter() - t0:.0f} s")
    after = head_accuracy(heads, lm_head, eval_h, eval_ids_t)
    log("held-out top-1 accuracy (offset 1 is the LM head itself; head i predicts offset i + 1):")
    for j, (a, b) in enumerate(zip(before, after)):
        name = "lm_head" if j == 0 else f"head {j}"
        log(f"  {name:8s} offset {j + 1}: {100 * b:5.1f}%" + ("" if j == 0 else f"  (untrained {100 * a:4.1f}%)"))
    return heads.eval(), {"losses": losses, "accuracy_before": before, "accuracy_after": after,
                          "train_tokens": len(train) * tc.seq_len, "eval_tokens": len(evals) * tc.seq_len,
                          "seconds": time.perf_counter() - t0}
