"""Medusa drafts: extra decoding heads on the target's last hidden state (Cai et al. 2024, "Medusa: Simple LLM
Inference Acceleration Framework with Multiple Decoding Heads"; Medusa-1: the target stays frozen, only the heads are
trained, see ``rooflm.spec_decode.medusa_train``).

Head i (1-based) reads the final hidden state h_t of position t, the state from which the LM head predicts token
t + 1, and predicts token t + i + 1: ``logits_i = lm_head(h + SiLU(W_i h + b_i))``, one residual block per head and
the target's own frozen LM head. W_i starts at zero, so an untrained head copies the LM head's prediction. The heads
are tiny (hidden_size^2 + hidden_size numbers each); their k rows go through the LM head in one matmul, which reads
its weights once: on a memory-bound decode that is the price of drafting, about one LM head read per step.

The drafts of a request come from the hidden state of the position that produced its newest token (the sampled row
of a plain step, or the row of the last accepted token of a verify step): the runner hands those rows over with
``observe`` and the heads propose right after the step, like the other model-based drafters (``drafter.py``). The
heads write no KV, so no lookahead slots are needed. Chain mode proposes the top token of heads 1..k (greedy
requests) or draws token i from head i's distribution q_i under the request's sampling parameters (random ones),
verified by the existing chain verification and rejection sampling; q_i does not depend on the drafts before it,
which the rejection sampler allows (each draft token is drawn from a known distribution given the accepted prefix).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from rooflm.config import ModelConfig
from rooflm.layers.sampler import argmax_tokens
from rooflm.spec_decode.config import SpeculativeConfig
from rooflm.spec_decode.drafter import Drafter, DraftRequest, decode_weight_bytes, weight_bytes

CONFIG_NAME = "medusa_config.json"
WEIGHTS_NAME = "medusa_heads.safetensors"


class MedusaHeads(nn.Module):
    """``num_heads`` residual blocks ``h + SiLU(W_i h + b_i)`` (the LM head is the target's, applied by the caller)."""

    def __init__(self, num_heads: int, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if num_heads < 1 or hidden_size < 1:
            raise ValueError(f"MedusaHeads: num_heads={num_heads} and hidden_size={hidden_size} must be positive")
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size, dtype=dtype))  # [k, out, in]
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size, dtype=dtype))

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None, product=None) -> torch.Tensor:
        """[N, H] -> [N, k, H]: the inputs of the LM head for heads 1..k (k = ``num_heads`` or all). ``product``:
        another implementation of h @ W^T for at least the first k heads' stacked W ([N, >= k * H] float32, the
        bias not added), e.g. the native kernel's 8-bit one (``native_heads``)."""
        k = self.num_heads if num_heads is None else num_heads
        if product is not None:
            h = hidden.float()
            z = product(h)[:, :k * self.hidden_size] + self.bias[:k].reshape(-1).float()
        else:
            h = hidden.to(self.weight.dtype)
            # the k blocks as one [k * H, H] product: a single matrix-vector call at decode (the einsum it replaces
            # took 68 against 61 us for one row and two heads of SmolLM2-135M on the CPU)
            z = F.linear(h, self.weight[:k].reshape(k * self.hidden_size, self.hidden_size),
                         self.bias[:k].reshape(-1))
        return (h.unsqueeze(1) + F.silu(z.view(-1, k, self.hidden_size))).to(hidden.dtype)


def model_identity(cfg: ModelConfig, name: str | None) -> dict[str, Any]:
    """What the heads were trained on, saved beside them (checked for size, shown for the rest)."""
    return {"model": None if name is None else os.path.basename(str(name).rstrip("/")),
            "architecture": getattr(cfg, "architecture", None),
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_hidden_layers": cfg.num_hidden_layers}


def save_medusa_heads(heads: MedusaHeads, path: str | os.PathLike, base: dict[str, Any]) -> None:
    """Write ``heads`` to the folder ``path``: safetensors weights and a small JSON (num_heads, hidden_size and the
    base model's identity from ``model_identity``)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"weight": heads.weight.detach().float().contiguous().cpu(),
               "bias": heads.bias.detach().float().contiguous().cpu()}, str(out / WEIGHTS_NAME))
    meta = {"num_heads": heads.num_heads, "hidden_size": heads.hidden_size, "base_model": base}
    (out / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")


def load_medusa_heads(path: str | os.PathLike, target_cfg: ModelConfig | None = None,
                      device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                      field: str = "speculative_config.model") -> tuple[MedusaHeads, dict[str, Any]]:
    """Load heads saved by ``save_medusa_heads``; with ``target_cfg``, check that they fit the target (hidden size
    and vocabulary: the heads feed the target's LM head). Raises ValueError naming the field otherwise."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
        raise ValueError(f"{field}={str(path)!r} is not a Medusa heads folder: expected {CONFIG_NAME} and "
                         f"{WEIGHTS_NAME} in it (see `rooflm train-medusa`)")
    meta = json.loads((folder / CONFIG_NAME).read_text())
    for key in ("num_heads", "hidden_size"):
        if not isinstance(meta.get(key), int) or meta[key] < 1:
            raise ValueError(f"{field}={str(path)!r}: {CONFIG_NAME} has {key}={meta.get(key)!r}, expected a positive "
                             "integer")
    base = meta.get("base_model") or {}
    if target_cfg is not None:
        if meta["hidden_size"] != target_cfg.hidden_size:
            raise ValueError(f"{field}={str(path)!r} has hidden_size={meta['hidden_size']}, the target "
                             f"{target_cfg.hidden_size}: Medusa heads read the target's hidden states")
        vocab = base.get("vocab_size")
        if vocab is not None and vocab != target_cfg.vocab_size:
            raise ValueError(f"{field}={str(path)!r} has vocab_size={vocab}, the target {target_cfg.vocab_size}: "
                             "Medusa heads were trained with another model's LM head")
    tensors = load_file(str(folder / WEIGHTS_NAME))
    heads = MedusaHeads(meta["num_heads"], meta["hidden_size"])
    k, hs = meta["num_heads"], meta["hidden_size"]
    for name, shape in (("weight", (k, hs, hs)), ("bias", (k, hs))):
        t = tensors.get(name)
        if t is None or tuple(t.shape) != shape:
            raise ValueError(f"{field}={str(path)!r}: {WEIGHTS_NAME} has {name} of shape "
                             f"{None if t is None else tuple(t.shape)}, expected {shape}")
    with torch.no_grad():
        heads.weight.copy_(tensors["weight"])
        heads.bias.copy_(tensors["bias"])
    return heads.to(device=device, dtype=dtype).eval(), meta


def fusable_lm_head(lm_head: nn.Module | None) -> bool:
    """Whether ``lm_head``'s product scores each row exactly as it would alone, whatever the other rows: the CPU's
    native quantized kernel does (each row's dot products are its own, in a fixed order); BLAS and GPU matmuls may
    pick another blocking for another number of rows, so the target's logits could move by a rounding."""
    cw = getattr(lm_head, "_cpu_weight", None)
    return getattr(cw, "kind", None) == "native" and getattr(cw, "perm", None) is None


def native_heads(heads: MedusaHeads, depth: int):
    """The first ``depth`` heads' matrices stacked [depth * H, H] and quantized to 8 bits per block of 32 columns
    (round to nearest, one scale a block) in the native kernel's layout; None without the native library."""
    from rooflm.kernels.cpu_native import native_library, pack_native
    from rooflm.quantization.rtn import quantize_rtn

    lib = native_library()
    h = heads.hidden_size
    if lib is None or h % 32:
        return None
    w = heads.weight[:depth].detach().float().reshape(depth * h, h)
    return pack_native(quantize_rtn(w, 8, 32, torch.float32), lib)


class MedusaDrafter(Drafter):
    """The runner's drafter for ``method: "medusa"`` (same interface as ``Drafter``; no KV cache of its own)."""

    def __init__(self, spec: SpeculativeConfig, target: nn.Module, target_cfg: ModelConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, block_size: int) -> None:
        heads, _ = load_medusa_heads(spec.model, target_cfg, device, dtype)
        if spec.num_speculative_tokens > heads.num_heads:
            raise ValueError(f"speculative_config.num_speculative_tokens={spec.num_speculative_tokens} is more than "
                             f"the {heads.num_heads} Medusa heads in {spec.model!r}")
        self.k = spec.num_speculative_tokens
        self.method = spec.method
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.enabled = True
        self.heads = heads
        self.tree = spec.tree_shape()  # None: chain proposals
        self.num_nodes = self.tree.num_nodes if self.tree is not None else self.k
        self.trees: dict[str, tuple[list[int], tuple[int, ...]]] = {}  # req_id -> (tree tokens, parents)
        self.compute_logits = target.compute_logits
        self.kv_caches: list = []
        self.owns_cache = False
        self.hidden = torch.zeros(0, target_cfg.hidden_size, dtype=dtype, device=device)  # per persistent row
        lm_head = getattr(target, "lm_head", None)
        # Heads drafted inside the step's own LM head product (``fused_logits``) where that product scores every
        # row exactly as it would alone; then the heads' logits of each persistent row are kept here until drafting.
        self.fuse = fusable_lm_head(lm_head)
        self.depth = self.tree.depth if self.tree is not None else self.k  # heads a proposal reads
        # There the heads' blocks run on the native kernel too, as 8-bit weights in blocks of 32 columns (llama.cpp's
        # Q8_0): a quarter of the float32 bytes, on the kernel's threads. On the 2-core CPU, one row of SmolLM2-135M's
        # head with a cold cache: 24 against 95 us, two rows 25 against 108 us. Drafts only: the target's logits do
        # not read them, and verification keeps the output exact whatever the heads propose.
        self.heads_q8 = native_heads(heads, self.depth) if self.fuse else None
        self.head_logits: dict[int, torch.Tensor] = {}  # persistent row -> [depth, V], from this step's product
        # The k heads' rows share one LM head matmul (its weights read once) and each reads its own W_i: the cost of
        # one step's drafts over a decode step, spread over its k drafts (the proposer counts k drafts' cost). Fused
        # into the step's product, the LM head's weights are read once for both, and only the heads' are extra.
        draft_bytes = (weight_bytes(lm_head) if lm_head is not None and not self.fuse else 0) + weight_bytes(heads)
        self.cost_fraction = draft_bytes / max(1, decode_weight_bytes(target)) / self.k
        self.pending: dict[str, tuple[list[int], torch.Tensor | None]] = {}

    def fused_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's logits of ``hidden`` [N, H] and, when this drafter fuses, its heads' logits [N, depth, V]
        from the same LM head product (one read of its weights: on a memory-bound CPU step a whole pass saved).
        Exact: the product scores each row as it would alone (``fusable_lm_head``)."""
        if not (self.fuse and self.enabled) or hidden.shape[0] == 0:
            return self.compute_logits(hidden), None
        n = hidden.shape[0]
        h = self._heads(hidden, self.depth).reshape(-1, hidden.shape[-1])
        logits = self.compute_logits(torch.cat((hidden, h.to(hidden.dtype))))
        return logits[:n], logits[n:].view(n, self.depth, -1)

    def _heads(self, hidden: torch.Tensor, depth: int) -> torch.Tensor:
        """[N, H] -> [N, depth, H]: the LM head's inputs of heads 1..depth (8-bit on the native kernel)."""
        if self.heads_q8 is None or depth > self.depth:
            return self.heads(hidden, depth)
        from rooflm.kernels.cpu_native import native_linear

        return self.heads(hidden, depth, product=lambda h: native_linear(h, self.heads_q8))

    def observe(self, rows: torch.Tensor, hidden: torch.Tensor, head_logits: torch.Tensor | None = None) -> None:
        """The final hidden states that produced the newest token of the requests in persistent ``rows`` (and their
        heads' logits [R, depth, V] when the step's LM head product made them)."""
        if rows.numel() == 0:
            return
        if head_logits is not None:
            for i, row in enumerate(rows.tolist()):
                self.head_logits[row] = head_logits[i]
        need = int(rows.max().item()) + 1
        if need > self.hidden.shape[0]:
            grown = torch.zeros(max(need, 2 * self.hidden.shape[0]), self.hidden.shape[1], dtype=self.hidden.dtype,
                                device=self.device)
            grown[:self.hidden.shape[0]] = self.hidden
            self.hidden = grown
        self.hidden.index_copy_(0, rows, hidden.to(self.hidden.dtype))

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self.pending.pop(rid, None)
            self.trees.pop(rid, None)

    def budget(self, position: int, num_blocks: int, max_drafts: int | None = None) -> int:
        """Medusa drafts write no KV: only the model's length and the request's remaining tokens bound them."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        return max(0, min(k, self.max_model_len - 1 - position))

    def _head_logits(self, reqs: list[DraftRequest], depth: int) -> torch.Tensor:
        """[n, depth, V] float32: the heads' logits of each request's newest hidden state, from the step's fused
        product where it made them (``fused_logits``), else from a product of their own."""
        kept, self.head_logits = self.head_logits, {}
        if all(r.row in kept for r in reqs):
            return torch.stack([kept[r.row][:depth] for r in reqs])
        rows = torch.tensor([r.row for r in reqs], device=self.device)
        h = self._heads(self.hidden.index_select(0, rows), depth)  # [n, depth, H]
        return self.compute_logits(h.reshape(-1, h.shape[-1])).view(len(reqs), depth, -1)

    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest], last_token: torch.Tensor) -> dict[str, list[int]]:
        self.pending = {}
        self.trees = {}
        reqs = [r for r in reqs if self.budget(r.position, len(r.block_ids), r.max_drafts) >= 1]
        if not reqs or not self.enabled:
            self.head_logits = {}
            return {}
        if self.tree is not None:
            return self._propose_trees(reqs)
        limits = [self.budget(r.position, len(r.block_ids), r.max_drafts) for r in reqs]
        k = max(limits)
        logits = self._head_logits(reqs, k)  # [n, k, V] float32
        greedy = [r.params.greedy or r.params.top_k == 1 for r in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        if all(greedy):  # every head's argmax in one call
            tokens = argmax_tokens(logits.reshape(len(reqs) * k, -1)).view(len(reqs), k).tolist()
        else:
            chosen = [self._choose(logits[:, j], reqs, greedy, probs) for j in range(k)]
            tokens = torch.stack(chosen, dim=1).tolist()  # [n, k]
        result = {}
        for i, r in enumerate(reqs):
            d = tokens[i][:limits[i]]
            result[r.req_id] = d
            self.pending[r.req_id] = (d, torch.stack(probs[i][:limits[i]]) if probs[i] else None)
        return result

    # -- token trees ----------------------------------------------------------------------------------------------------
    def _propose_trees(self, reqs: list[DraftRequest]) -> dict[str, list[int]]:
        """Each request's tree: node (a, b, ...) of depth d holds head d's candidate of rank path[-1] (its top-k,
        deterministic for greedy and random requests alike: the verifier needs no draft distribution). A tree is
        cut to the request's remaining tokens (depth) and to the model's length (nodes, one KV slot each)."""
        shape = self.tree
        logits = self._head_logits(reqs, shape.depth)
        top = logits.topk(shape.top_k(), dim=-1).indices.tolist()  # [n, depth, top_k]
        result = {}
        for r, cand in zip(reqs, top):
            depth = shape.depth if r.max_drafts is None else min(shape.depth, r.max_drafts)
            cut = shape.within_depth(depth)
            cut = cut.prefix(min(cut.num_nodes, self.max_model_len - 1 - r.position))
            if cut.num_nodes == 0:
                continue
            tokens = [cand[len(p) - 1][p[-1]] for p in cut.paths]
            result[r.req_id] = tokens
            self.trees[r.req_id] = (tokens, cut.parents)
        return result

    def tree_for(self, req_id: str, drafts: list[int]) -> tuple[int, ...] | None:
        """The parents of the scheduled ``drafts`` when they are (a breadth-first prefix of) this request's tree."""
        tree = self.trees.get(req_id)
        if tree is None or tree[0][:len(drafts)] != drafts:
            return None
        return tree[1][:len(drafts)]

    def verify_trees(self, logits: torch.Tensor, md, states: list, drafts: list[list[int]],
                     parents: list[tuple[int, ...]], kv_caches: list,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Verify each request's tree (``tree.verify_tree``: greedy, or SpecInfer's multi-candidate rejection
        sampling) and move the accepted path's KV to consecutive slots. ``logits`` [S, V]: request after request,
        the root's row then its nodes'. Returns (tokens [R, D + 1] padded with -1, accepted [R], the row of each
        request's last accepted node within its own rows [R])."""
        from rooflm.layers.sampler import target_probs
        from rooflm.spec_decode.tree import compact_kv, verify_tree

        greedy = [s.params.greedy or s.params.top_k == 1 for s in states]
        probs = None if all(greedy) else target_probs(logits, md)
        outs, accepted, last, start = [], [], [], 0
        for s, d, par, g in zip(states, drafts, parents, greedy):
            rows = slice(start, start + len(d) + 1)
            start += len(d) + 1
            path, toks = verify_tree(logits[rows] if g else probs[rows], d, par, g, s.generator)
            root = s.num_computed_tokens - len(d) - 1 - s.num_dropped  # the root's cache index
            compact_kv(kv_caches, s.block_ids, block_size, root, path)
            outs.append(toks)
            accepted.append(len(path))
            last.append(path[-1] if path else 0)
        width = max(len(t) for t in outs)
        tokens = torch.tensor([t + [-1] * (width - len(t)) for t in outs], device=logits.device)
        return tokens, torch.tensor(accepted, device=logits.device), torch.tensor(last, device=logits.device)
