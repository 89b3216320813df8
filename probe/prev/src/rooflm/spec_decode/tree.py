"""Token trees: several candidates per draft position, verified in one forward pass (SpecInfer, Miao et al. 2024;
Medusa, Cai et al. 2024, section 2.1.2).

A tree is a fixed sparse shape of *paths*: the path (a, b) is the a-th candidate of head 1 followed by the b-th
candidate of head 2. Every path's prefixes are in the tree too. Nodes are numbered in breadth-first order (by depth,
then by path), 1..T; node 0 is the root: the request's newest token, not yet in the cache. A verify step runs the
root and the T nodes as T + 1 query tokens: node j sits in cache slot p0 + j (p0: the root's position) but at RoPE
position p0 + depth(j), and attends the cached prefix plus its own ancestors only (``attention_mask``). Any
breadth-first prefix of the nodes is again a tree, so the scheduler may cut the list like a chain's.

Verification walks down from the root, keeping at each node the child the target agrees with:
- greedy: the child whose token is the target's argmax at the node (exactly plain greedy decoding);
- random: SpecInfer's multi-candidate speculative sampling for deterministic candidates: with p the target's
  distribution at the node, child c_1 is accepted with probability p(c_1); on rejection c_1's mass is removed from p
  (the residual max(p - one_hot(c_1), 0), renormalised) and c_2 is tried against it, and so on; when every child is
  rejected, the output token is drawn from what is left. Each output token follows p exactly (this is sampling
  without replacement, one candidate at a time), whatever the candidates are.
The accepted path's KV then moves from slots p0 + node to p0 + 1, p0 + 2, ... (``compact_kv``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rooflm.layers.sampler import argmax_tokens

# The first paths of Medusa's default sparse tree for 4 heads, by the frequency with which they were accepted, cut to
# 15 nodes: a small model on a CPU pays for every extra query token.
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 0, 1), (0, 0, 0, 0), (0, 1, 0), (1, 1),
    (2, 0), (0, 0, 0, 1))


@dataclass(frozen=True)
class TreeShape:
    paths: tuple[tuple[int, ...], ...]  # breadth-first: node j + 1 is paths[j]
    parents: tuple[int, ...]  # node j + 1's parent (0: the root)
    depths: tuple[int, ...]  # node j + 1's depth (1: a candidate of head 1)

    @classmethod
    def from_choices(cls, choices, field: str = "speculative_config.tree") -> "TreeShape":
        """From a list of paths (lists of candidate ranks); raises ValueError naming ``field`` on a bad one."""
        try:
            paths = sorted({tuple(int(c) for c in p) for p in choices}, key=lambda p: (len(p), p))
            bad = [p for p in paths if not p or min(p) < 0]
            bad += [list(c) for c in choices if any(not isinstance(x, int) or isinstance(x, bool) for x in c)]
        except (TypeError, ValueError):
            raise ValueError(f"{field}={choices!r} is invalid: expected a list of paths (lists of candidate "
                             "ranks >= 0)") from None
        if not paths or bad:
            raise ValueError(f"{field}={choices!r} is invalid: expected a non-empty list of non-empty paths of "
                             f"candidate ranks >= 0{f' (not {list(bad[0])})' if bad else ''}")
        index = {p: j + 1 for j, p in enumerate(paths)}
        missing = [p for p in paths if len(p) > 1 and p[:-1] not in index]
        if missing:
            raise ValueError(f"{field}: the path {list(missing[0])} has no parent path {list(missing[0][:-1])} in "
                             "the tree")
        return cls(tuple(paths), tuple(index.get(p[:-1], 0) for p in paths), tuple(len(p) for p in paths))

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def top_k(self) -> int:
        """How many candidates per head the tree reads (the largest rank + 1)."""
        return 1 + max(max(p) for p in self.paths)

    def prefix(self, n: int) -> "TreeShape":
        """Its first ``n`` nodes (a tree: parents come before their children)."""
        return TreeShape(self.paths[:n], self.parents[:n], self.depths[:n])

    def within_depth(self, d: int) -> "TreeShape":
        keep = [j for j, depth in enumerate(self.depths) if depth <= d]  # breadth-first: a prefix
        return self.prefix(len(keep))


def attention_mask(parents: list[int] | tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """[T + 1, T + 1] bool: query i (0: the root) may attend key j of the tree's tokens iff j is i or an ancestor."""
    n = len(parents) + 1
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    for j, parent in enumerate(parents, start=1):
        mask[j] |= mask[parent]
    return mask.to(device)


def tree_depths(parents: list[int] | tuple[int, ...], root_pos: int = 0) -> list[int]:
    """The RoPE positions of the root and the nodes: ``root_pos`` + depth (a node's position is its path's)."""
    pos = [root_pos]
    for parent in parents:
        pos.append(pos[parent] + 1)
    return pos


def tree_tokens(shape: TreeShape, candidates: list[list[int]]) -> list[int]:
    """The nodes' tokens: node (a, b, ...) of depth d is candidate path[-1] of head d (``candidates[d - 1]``)."""
    return [candidates[len(p) - 1][p[-1]] for p in shape.paths]


def verify_tree(probs_or_logits: torch.Tensor, tokens: list[int], parents: list[int] | tuple[int, ...], greedy: bool,
                generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """One request's verification. ``probs_or_logits`` [T + 1, V]: row 0 for the root, row j for node j (greedy:
    any scores; random: the target's sampling distribution p at each row). Returns (the accepted nodes in order,
    the output tokens: the accepted nodes' tokens and one token of the target's own)."""
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(parents, start=1):
        children.setdefault(parent, []).append(j)
    node, path, out = 0, [], []
    if greedy:
        best = argmax_tokens(probs_or_logits).tolist()
        while True:
            nxt = next((c for c in children.get(node, []) if tokens[c - 1] == best[node]), None)
            if nxt is None:
                return path, out + [best[node]]
            node = nxt
            path.append(node)
            out.append(tokens[node - 1])
    # Random: a fixed count of uniforms per step (one per node, one for the extra token), from the request's own
    # generator when seeded, so its tokens do not depend on the batch around it.
    device = generator.device if generator is not None else "cpu"
    u = torch.rand(len(tokens) + 1, generator=generator, dtype=torch.float64, device=device).tolist()
    probs = probs_or_logits.double().cpu()
    draws = iter(u)
    while True:
        p = probs[node].clone()
        nxt = None
        for c in children.get(node, []):
            t = tokens[c - 1]
            total = p.sum().item()
            if total > 0 and next(draws) * total < p[t].item():
                nxt = c
                break
            p[t] = 0.0  # the residual after rejecting a one-hot draft: c's mass removed
        if nxt is None:
            cdf = torch.cumsum(p, 0)
            x = next(draws, u[-1]) * cdf[-1].item()
            token = int(torch.searchsorted(cdf, torch.tensor([x], dtype=cdf.dtype), right=True).clamp(
                max=p.numel() - 1).item())
            while p[token] == 0 and token > 0:  # never a token with no mass left (float ties at the boundary)
                token -= 1
            return path, out + [token]
        node = nxt
        path.append(node)
        out.append(tokens[node - 1])


def compact_kv(kv_caches: list, block_table: list[int], block_size: int, root_pos: int, path: list[int]) -> None:
    """Move the accepted nodes' K and V from slots ``root_pos + node`` to ``root_pos + 1, 2, ...`` in every layer
    (gathered first, then written: a source never lies below its destination)."""
    moves = [(root_pos + node, root_pos + i) for i, node in enumerate(path, start=1) if node != i]
    if not moves:
        return

    def slot(pos: int) -> int:
        return block_table[pos // block_size] * block_size + pos % block_size

    device = kv_caches[0].device if isinstance(kv_caches[0], torch.Tensor) else None
    src = torch.tensor([slot(s) for s, _ in moves], device=device)
    dst = torch.tensor([slot(d) for _, d in moves], device=device)
    for cache in kv_caches:
        if not isinstance(cache, torch.Tensor):
            raise ValueError("token trees need a float KV cache: kv_cache_dtype='auto'")
        flat = cache.view(2, -1, *cache.shape[3:])  # [2, blocks * block_size, Hkv, D]
        flat[:, dst] = flat[:, src]
