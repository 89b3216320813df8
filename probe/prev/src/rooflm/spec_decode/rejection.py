"""Verification of draft tokens, on the device, for a batch of requests with different draft lengths.

Request r proposes draft tokens ``x[r, :k_r]``; the target model scored positions ``0..k_r`` (position j predicts
the token after draft token j - 1). The output is the longest accepted prefix of the draft plus one token of the
target's own, so every step yields between 1 and k_r + 1 tokens:

- greedy rows accept ``x_j`` while it equals the target's argmax at j; the extra token is the argmax at the first
  mismatch (or at k_r when all match). The output is exactly what plain greedy decoding gives.
- random rows use rejection sampling (Leviathan et al. 2023; Chen et al. 2023). A deterministic proposer (prompt lookup)
  is a draft distribution q that puts all its mass on x_j, so x_j is accepted with probability min(1, p(x_j) / q(x_j))
  = p(x_j); at the first rejection the extra token is drawn from the residual max(p - q, 0), i.e. p with x_j removed,
  renormalised; when every draft token is accepted it is drawn from p at position k_r. Each output token then follows
  the target distribution p exactly.

A draft model proposes by sampling from its own distribution q (``draft_probs``): x_j is then accepted with
probability min(1, p(x_j) / q(x_j)) and the extra token at the first rejection is drawn from max(p - q, 0),
renormalised; the deterministic case above is q = one-hot(x_j). Greedy rows ignore q.

``p`` is the distribution the sampler itself draws from (temperature, min_p, top-k, top-p: ``target_probs``).
Seeded requests draw their uniforms and exponentials from their own generator, k_r + (k_r + 1)·V numbers per step,
so their tokens do not depend on the batch around them.
"""
from __future__ import annotations

import torch

from rooflm.layers.sampler import SamplingMetadata, argmax_tokens, target_probs


def verify(logits: torch.Tensor, draft: list[list[int]], md: SamplingMetadata | None, greedy: list[bool],
           generators: list[torch.Generator | None],
           draft_probs: list[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [S, V]: request r's k_r + 1 rows, request after request (S = sum of k_r + 1); ``md``: the sampling
    metadata of those S rows (each request's parameters repeated; its generators are not used; None when every
    request is greedy); ``draft_probs``: per request None (a deterministic proposer) or the [>= k_r, V]
    distributions its draft tokens were drawn from. Returns (tokens [R, K + 1] int64, -1 after each request's last
    output token; num_accepted [R] int64), K = max k_r."""
    device = logits.device
    r_n = len(draft)
    lens = [len(d) for d in draft]
    if r_n == 0 or min(lens) < 1:
        raise ValueError("verify: every request needs at least one draft token")
    k_max = max(lens)
    idx, x_pad = [], []
    start = 0
    for d in draft:
        idx.append([start + min(j, len(d)) for j in range(k_max + 1)])  # padding repeats the last valid row
        x_pad.append(d + [0] * (k_max - len(d)))
        start += len(d) + 1
    if start != logits.shape[0]:
        raise ValueError(f"verify: {logits.shape[0]} logits rows for drafts that need {start}")
    if device.type == "cpu" and all(greedy):
        return _verify_greedy_host(argmax_tokens(logits).tolist(), draft, k_max)
    host = torch.tensor([lens] + [[int(g) for g in greedy]], dtype=torch.int64)
    idx_t = torch.tensor(idx, dtype=torch.int64).to(device, non_blocking=True)  # [R, K+1]
    x = torch.tensor(x_pad, dtype=torch.int64).to(device, non_blocking=True)  # [R, K]
    lens_t, greedy_t = host.to(device, non_blocking=True)
    cols = torch.arange(k_max + 1, device=device)
    draft_valid = cols[:k_max].unsqueeze(0) < lens_t.unsqueeze(1)  # [R, K]

    argmax = argmax_tokens(logits)[idx_t]  # [R, K+1]
    accept = x == argmax[:, :k_max]
    corr = argmax
    if not all(greedy):
        probs = target_probs(logits.float(), md)[idx_t]  # [R, K+1, V]
        v = probs.shape[-1]
        p_x = probs[:, :k_max].gather(2, x.unsqueeze(2)).squeeze(2)  # [R, K]
        u = torch.rand(r_n, k_max, device=device)
        noise = torch.empty(r_n, k_max + 1, v, device=device).exponential_()
        for r, g in enumerate(generators):
            if g is not None and not greedy[r]:  # host ints: views, no sync
                u[r, :lens[r]] = torch.rand(lens[r], device=device, generator=g)
                noise[r, :lens[r] + 1].exponential_(generator=g)
        if draft_probs is not None and any(q is not None for q in draft_probs):
            q = torch.zeros(r_n, k_max, v, dtype=probs.dtype, device=device)
            q.scatter_(2, x.unsqueeze(2), 1.0)  # deterministic proposers: q = one-hot(x)
            for r, qr in enumerate(draft_probs):
                if qr is not None and not greedy[r]:
                    q[r, :lens[r]] = qr[:lens[r]].to(probs.dtype)
            q_x = q.gather(2, x.unsqueeze(2)).squeeze(2)
            residual = (probs[:, :k_max] - q).clamp_(min=0.0)  # max(p - q, 0)
            empty = residual.sum(dim=2, keepdim=True) <= 0  # p == q: a rejection has probability 0 there
            residual = torch.where(empty, probs[:, :k_max], residual)
            p_x = p_x / q_x.clamp(min=torch.finfo(q_x.dtype).tiny)  # min(1, p / q) is compared with u below
        else:
            residual = probs[:, :k_max].clone()
            residual.scatter_(2, x.unsqueeze(2), 0.0)  # p with the draft token removed
        residual = torch.where(draft_valid.unsqueeze(2), residual, probs[:, :k_max])
        residual = torch.cat([residual, probs[:, k_max:]], dim=1)  # row k_r: the extra token after a full chain
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        sampled = (residual / noise).argmax(dim=-1)  # [R, K+1]
        is_greedy = greedy_t.bool()
        accept = torch.where(is_greedy.unsqueeze(1), accept, u < p_x)
        corr = torch.where(is_greedy.unsqueeze(1), argmax, sampled)
    accept &= draft_valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [R]
    bonus = corr.gather(1, num_accepted.unsqueeze(1))  # [R, 1]
    x_ext = torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)
    tokens = torch.where(cols < num_accepted.unsqueeze(1), x_ext,
                         torch.where(cols == num_accepted.unsqueeze(1), bonus, torch.full_like(x_ext, -1)))
    return tokens, num_accepted


def _verify_greedy_host(argmax: list[int], draft: list[list[int]], k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify`` for greedy rows whose logits are on the host: the same tokens and counts from the argmax list, in
    a few list operations instead of a dozen small tensor ones (a tenth of a CPU verify step's overhead)."""
    tokens, accepted, start = [], [], 0
    for d in draft:
        best = argmax[start:start + len(d) + 1]
        n = 0
        while n < len(d) and d[n] == best[n]:
            n += 1
        tokens.append(d[:n] + [best[n]] + [-1] * (k_max - n))
        accepted.append(n)
        start += len(d) + 1
    return torch.tensor(tokens, dtype=torch.int64), torch.tensor(accepted, dtype=torch.int64)
