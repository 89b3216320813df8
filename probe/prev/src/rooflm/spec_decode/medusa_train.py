"""Training Medusa-1 heads on a frozen model (Cai et al. 2024, section 2.2.1): only the heads learn; the model's
forward gives the final hidden states h_t, and head i is trained with the cross-entropy of
``lm_head(h_t + SiLU(W_i h_t + b_i))`` against token t + i + 1, through the model's own frozen LM head.

The labels are either the training text itself or, with ``self_distill`` > 0, the model's own greedy continuations of
prompts taken from it (the paper's self-distillation, section 2.3.2; see ``rooflm.spec_decode.medusa_distill``):
greedy verification accepts a draft when it equals the model's argmax, so those are the tokens the heads must hit.

The model is frozen, so each sequence goes through it once, before the first step: its final hidden states are kept
on the model's device (float32, ``hidden_size`` x 4 bytes per trained position; ``max_cache_gb`` bounds the total)
and reused by every epoch, and a step costs only the heads and the LM head (forward and backward to the heads'
outputs). Everything runs on the model's device; the heads come back on the CPU, ready to save.
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
from rooflm.spec_decode.medusa_distill import IGNORE, Example, distilled_examples

# The command-line flag of each config field whose name differs from the field's (errors name both).
_FLAGS = {"num_heads": "--heads"}


def _flag(name: str) -> str:
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


@dataclass
class MedusaTrainConfig:
    num_heads: int = 4
    steps: int = 200
    lr: float = 2e-3
    seq_len: int = 256  # tokens per window of text (human-text training and its held-out report)
    batch_size: int = 2  # sequences per step
    max_train_tokens: int = 16384  # distinct training positions of human text (their hidden states are computed once)
    eval_tokens: int = 1024  # held-out positions for the human-text accuracy report
    warmup_steps: int = 10
    weight_decay: float = 0.0
    log_every: int = 20
    seed: int = 0
    # Self-distillation (Cai et al. 2024, section 2.3.2): train on this many greedy continuations of the model itself
    # (prompts: windows of distill_prompt_len tokens of the training text; continuations of up to distill_len tokens).
    # 0: train on the human text.
    self_distill: int = 0
    distill_len: int = 256
    distill_prompt_len: int = 64
    distill_eval: int = 8  # held-out greedy continuations (prompts from the evaluation text) for the greedy report
    distill_soft: bool = False  # self-distillation against the model's distributions instead of its greedy tokens
    max_cache_gb: float = 8.0  # refuse to start when the kept hidden states would take more

    def __post_init__(self) -> None:
        for name in ("num_heads", "steps", "seq_len", "batch_size", "max_train_tokens", "eval_tokens", "log_every",
                     "distill_len", "distill_prompt_len", "distill_eval"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                self._fail(name, "expected a positive integer")
        if not isinstance(self.self_distill, int) or isinstance(self.self_distill, bool) or self.self_distill < 0:
            self._fail("self_distill", "expected a number of sequences >= 0 (0: train on the human text)")
        for name in ("lr", "max_cache_gb"):
            if not getattr(self, name) > 0:
                self._fail(name, "expected a positive number")
        if self.seq_len <= self.num_heads + 1:
            self._fail("seq_len", f"it must exceed num_heads + 1 = {self.num_heads + 1} (head i is trained on token "
                                  "t + i + 1)")
        if self.distill_soft and not self.self_distill:
            self._fail("distill_soft", "soft labels need --self-distill N (on human text the model's distribution "
                                       "is not the text's)")
        if self.self_distill and self.distill_len <= self.num_heads:
            self._fail("distill_len", f"it must exceed num_heads = {self.num_heads} (head i is trained on token "
                                      "t + i + 1 of the continuation)")

    def _fail(self, name: str, why: str) -> None:
        raise ValueError(f"MedusaTrainConfig.{name}={getattr(self, name)!r} ({_flag(name)}) is invalid: {why}")


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


def model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where the model runs and its activations' dtype (that of its floating-point embedding)."""
    emb = model.model.embed_tokens.weight
    return emb.device, emb.dtype


@torch.inference_mode()
def hidden_states(model: nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                  ids: list[int]) -> torch.Tensor:
    """The final hidden states [T, H] (float32, on the model's device) of one sequence (a fresh scratch cache)."""
    from rooflm.attention.metadata_utils import allocate_kv_caches, single_sequence_metadata

    block = 16
    device, dtype = model_device_dtype(model)
    caches = allocate_kv_caches(num_layers, -(-len(ids) // block), block, num_kv_heads, head_dim, dtype=dtype,
                                device=device)
    meta, pos = single_sequence_metadata(0, len(ids), block, device=device)
    return model(torch.tensor(ids, device=device), pos, caches, meta).float().clone()


def _head_inputs(heads: MedusaHeads, i: int, h: torch.Tensor) -> torch.Tensor:
    return h + F.silu(h @ heads.weight[i - 1].t() + heads.bias[i - 1])


def head_losses(heads: MedusaHeads, lm_head: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor,
                soft: bool = False) -> list[torch.Tensor]:
    """Per head i (1-based), the mean cross-entropy of its prediction at t against ids[t + i + 1], over the targets
    that are not IGNORE (prompt tokens and padding). hidden [B, L, H], ids [B, L]. ``soft``: against the model's own
    distribution of that token instead, softmax(lm_head(hidden[t + i])) (the paper's self-distillation loss; on
    greedy continuations its argmax is the label)."""
    out = []
    for i in range(1, heads.num_heads + 1):
        target = ids[:, i + 1:]
        keep = target != IGNORE
        x = _head_inputs(heads, i, hidden[:, :-(i + 1)][keep])  # only the rows with a target: none wasted on padding
        if soft:
            with torch.no_grad():
                label = torch.softmax(hidden[:, i:-1][keep] @ lm_head.t(), dim=-1)
        else:
            label = target[keep]
        out.append(F.cross_entropy(x @ lm_head.t(), label, reduction="sum") / keep.sum().clamp(min=1))
    return out


@torch.no_grad()
def predictions(heads: MedusaHeads, lm_head: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """[k + 1, L]: at each position t of one sequence (hidden [L, H]), the LM head's argmax (for token t + 1), then
    head i's (for token t + i + 1)."""
    rows = [hidden @ lm_head.t()] + [_head_inputs(heads, i, hidden) @ lm_head.t()
                                     for i in range(1, heads.num_heads + 1)]
    return torch.stack([r.argmax(-1) for r in rows])


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, lm_head: torch.Tensor, data: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[list[float], list[float]]:
    """Top-1 accuracy at offsets 1..k+1 (the LM head's own next token, then each head's token t + i + 1) over the
    targets that are not IGNORE, and the mean accepted length a greedy chain of j = 1..k Medusa drafts would reach
    (1 + the number of leading heads right, capped at j, over the positions whose k targets all exist): the
    prediction of ``acceptance`` when the labels are the model's greedy tokens."""
    k = heads.num_heads
    right = [0] * (k + 1)
    total = [0] * (k + 1)
    runs: list[torch.Tensor] = []
    for hidden, ids in data:
        pred = predictions(heads, lm_head, hidden)
        ok = []
        for j in range(k + 1):
            target = ids[j + 1:]
            keep = target != IGNORE
            hit = (pred[j, :len(target)] == target) & keep
            right[j] += int(hit.sum())
            total[j] += int(keep.sum())
            ok.append(hit)
        n = max(0, len(ids) - k - 1)  # positions with every head's target inside the sequence
        full = ids[k + 1:k + 1 + n] != IGNORE
        heads_ok = torch.stack([o[:n] for o in ok[1:]])[:, full]  # [k, m]
        runs.append(torch.cumprod(heads_ok.long(), 0).sum(0))  # leading heads right, per position
    acc = [r / t if t else float("nan") for r, t in zip(right, total)]
    run = torch.cat(runs) if runs else torch.zeros(0)
    chain = [1 + run.clamp(max=j).float().mean().item() if run.numel() else float("nan") for j in range(1, k + 1)]
    return acc, chain


def windows(ids: list[int], seq_len: int, max_tokens: int) -> list[list[int]]:
    n = min(len(ids), max_tokens) // seq_len
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(n)]


def encode(model: nn.Module, cfg, examples: list[Example]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each example's kept hidden states [L - first, H] and labels [L - first] on the model's device."""
    geometry = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    device, _ = model_device_dtype(model)
    return [(hidden_states(model, *geometry, e.ids)[e.first:], torch.tensor(e.labels(), device=device))
            for e in examples]


def pad_batch(data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack sequences of different lengths: hidden padded with zeros, labels with IGNORE."""
    length = max(len(ids) for _, ids in data)
    h0, i0 = data[0]
    hidden = h0.new_zeros(len(data), length, h0.shape[-1])
    ids = i0.new_full((len(data), length), IGNORE)
    for b, (h, i) in enumerate(data):
        hidden[b, :len(i)] = h
        ids[b, :len(i)] = i
    return hidden, ids


def _check_cache(num_sequences: int, positions: int, hidden_size: int, tc: MedusaTrainConfig) -> float:
    """GB of kept hidden states for ``positions`` in all (an upper bound before generation); refused over the limit."""
    gb = positions * hidden_size * 4 / 1e9
    if gb > tc.max_cache_gb:
        raise ValueError(f"MedusaTrainConfig.max_cache_gb={tc.max_cache_gb} (--max-cache-gb) is invalid for this run: "
                         f"the hidden states of {num_sequences} sequences take up to {gb:.3g} GB (float32, "
                         f"{hidden_size} numbers per position); lower --self-distill, --distill-len or "
                         "--max-train-tokens, or raise it")
    return gb


def train_medusa(model: nn.Module, cfg, train_ids: list[int], eval_ids: list[int], tc: MedusaTrainConfig,
                 log: Callable[[str], None] = print) -> tuple[MedusaHeads, dict]:
    """Train ``tc.num_heads`` heads on ``train_ids`` (the text, or with ``tc.self_distill`` the model's greedy
    continuations of prompts from it); report top-1 accuracy on ``eval_ids`` before and after: against the text and,
    when self-distilling, against the model's greedy continuations of held-out prompts (with the predicted mean
    accepted length of greedy Medusa chains). ``cfg``: the model's ModelConfig; the model may be on any device.
    Returns the heads (on the CPU, float32) and a summary (losses, accuracies, seconds)."""
    torch.manual_seed(tc.seed)
    rng = random.Random(tc.seed)
    device, dtype = model_device_dtype(model)
    t0 = time.perf_counter()
    text_eval = [Example(w) for w in windows(eval_ids, tc.seq_len, max(tc.eval_tokens, tc.seq_len))]
    if not text_eval:
        raise ValueError(f"train-medusa: the evaluation text has {len(eval_ids)} tokens, fewer than one window of "
                         f"seq_len={tc.seq_len}")
    greedy_eval: list[Example] = []
    text_positions = len(text_eval) * tc.seq_len
    if tc.self_distill:  # each continuation keeps the prompt's last position and up to distill_len generated ones
        n = tc.self_distill + tc.distill_eval
        gb = _check_cache(n + len(text_eval), n * (tc.distill_len + 1) + text_positions, cfg.hidden_size, tc)
        log(f"generating {tc.self_distill} + {tc.distill_eval} greedy continuations of up to {tc.distill_len} tokens "
            f"(prompts of {tc.distill_prompt_len} tokens) on {device}")
        train, greedy_eval = distilled_examples(
            model, cfg, [(train_ids, tc.self_distill, "self_distill"), (eval_ids, tc.distill_eval, "distill_eval")],
            tc.distill_prompt_len, tc.distill_len, device, dtype, tc.seed)
        log(f"  {sum(len(e.ids) - e.first - 1 for e in train)} generated training tokens, "
            f"{time.perf_counter() - t0:.0f} s")
    else:
        train = [Example(w) for w in windows(train_ids, tc.seq_len, tc.max_train_tokens)]
        if not train:
            raise ValueError(f"train-medusa: the training text has {len(train_ids)} tokens, fewer than one window of "
                             f"seq_len={tc.seq_len}")
        gb = _check_cache(len(train) + len(text_eval), len(train) * tc.seq_len + text_positions, cfg.hidden_size, tc)
    lm_head = lm_head_matrix(model).float()
    heads = MedusaHeads(tc.num_heads, cfg.hidden_size).to(device)
    train_data = encode(model, cfg, train)  # the model is frozen: each sequence runs through it once
    text_data = encode(model, cfg, text_eval)
    greedy_data = encode(model, cfg, greedy_eval)
    log(f"hidden states of {len(train)} training sequences kept (at most {gb:.3g} GB with the held-out ones), "
        f"{time.perf_counter() - t0:.0f} s")
    before, _ = head_accuracy(heads, lm_head, text_data)
    g_before, g_chain_before = head_accuracy(heads, lm_head, greedy_data) if greedy_data else ([], [])
    opt = torch.optim.AdamW(heads.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    order: list[int] = []
    losses: list[float] = []
    window_loss: list[list[float]] = []
    for step in range(1, tc.steps + 1):
        if len(order) < tc.batch_size:  # a new epoch: every sequence once, in a new order
            epoch = list(range(len(train)))
            rng.shuffle(epoch)
            order += epoch
        idx, order = order[:tc.batch_size], order[tc.batch_size:]
        hidden, ids = pad_batch([train_data[i] for i in idx])
        scale = min(1.0, step / tc.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / tc.steps)))
        for g in opt.param_groups:
            g["lr"] = tc.lr * scale
        per_head = head_losses(heads, lm_head, hidden, ids, soft=tc.distill_soft)
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
    after, _ = head_accuracy(heads, lm_head, text_data)
    g_after, g_chain = head_accuracy(heads, lm_head, greedy_data) if greedy_data else ([], [])
    _report(log, "held-out top-1 accuracy against the text", before, after)
    if greedy_data:
        _report(log, "held-out top-1 accuracy against the model's greedy tokens (what greedy verification accepts)",
                g_before, g_after)
        log("  predicted mean accepted length of a greedy chain of k drafts: " + ", ".join(
            f"k={j + 1}: {c:.2f} (untrained {b:.2f})" for j, (b, c) in enumerate(zip(g_chain_before, g_chain))))
    return heads.cpu().eval(), {
        "losses": losses, "accuracy_before": before, "accuracy_after": after,
        "greedy_accuracy_before": g_before, "greedy_accuracy_after": g_after,
        "accepted_length_before": g_chain_before, "accepted_length": g_chain,
        "train_tokens": sum(len(e.ids) - e.first for e in train), "eval_tokens": len(text_eval) * tc.seq_len,
        "greedy_eval_tokens": sum(len(e.ids) - e.first - 1 for e in greedy_eval),
        "seconds": time.perf_counter() - t0}


def _report(log: Callable[[str], None], title: str, before: list[float], after: list[float]) -> None:
    log(f"{title} (offset 1 is the LM head itself; head i predicts offset i + 1):")
    for j, (a, b) in enumerate(zip(before, after)):
        name = "lm_head" if j == 0 else f"head {j}"
        log(f"  {name:8s} offset {j + 1}: {100 * b:5.1f}%" + ("" if j == 0 else f"  (untrained {100 * a:4.1f}%)"))
