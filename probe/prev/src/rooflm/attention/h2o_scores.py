"""Per-block attention scores for H2O KV compression (Zhang et al. 2023; ``rooflm.kv_cache.compression``).

H2O ranks cached tokens by the attention probability they have received, accumulated over the steps. The fused
attention kernels (Triton, SDPA on the CPU) never materialise the probabilities, so for the requests the scheduler
names (``SchedulerOutput.attn_score_req_ids``) the attention layer calls ``BlockScoreCollector.add`` after its
attention: it recomputes ``softmax(q · kᵀ · scale)`` over the request's cached keys in plain torch (causal within the
step's queries) and adds, per cache block, the probability mass its keys received, summed over the step's queries,
the heads and the layers. One block table serves every head and layer, so a block's score is that sum rather than
the paper's per-head scores.

Cost: one extra ``[queries, heads, context]`` score matrix per layer for each such request, the size of an unfused
attention's (the same arithmetic again as the attention itself, plus its memory); other requests in the batch pay
nothing. On CUDA the scores are read back to the host every step (a synchronisation), and decode CUDA graphs are
not used for steps that collect scores.
"""
from __future__ import annotations

import torch

__all__ = ["BlockScoreCollector"]


class BlockScoreCollector:
    """``rows``: (request id, index of the request in the step's batch). ``block_size``, the metadata's block
    tables, query start offsets and cache lengths locate each request's queries and keys."""

    def __init__(self, rows: list[tuple[str, int]], block_size: int, block_tables: torch.Tensor,
                 query_start_loc: list[int], seq_lens: list[int]) -> None:
        self.block_size = block_size
        self._rows = []
        for rid, i in rows:
            n_blocks = -(-seq_lens[i] // block_size)
            self._rows.append((rid, query_start_loc[i], query_start_loc[i + 1], seq_lens[i],
                               block_tables[i, :n_blocks].long()))
        self.sums = {rid: torch.zeros(-(-seq_lens[i] // block_size), dtype=torch.float32, device=block_tables.device)
                     for rid, i in rows}

    def add(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> None:
        """One layer: ``q`` [num_tokens, heads, head_dim] (rotated), ``kv_cache`` [2, blocks, block_size, kv_heads,
        head_dim] already holding this step's keys."""
        if not isinstance(kv_cache, torch.Tensor):
            raise ValueError("kv_compression method 'h2o' needs an unquantized KV cache (kv_cache_dtype='auto')")
        bs = self.block_size
        for rid, start, end, ctx, blocks in self._rows:
            qs = q[start:end].float()  # [n, H, D]
            n, heads = qs.shape[0], qs.shape[1]
            k = kv_cache[0].index_select(0, blocks).reshape(-1, kv_cache.shape[-2], kv_cache.shape[-1])[:ctx]
            k = k.float().repeat_interleave(heads // k.shape[1], dim=1)  # grouped-query heads share a key head
            logits = torch.einsum("nhd,lhd->hnl", qs, k) * scale
            # query j of the step sits at cache index ctx - n + j and sees the keys up to it
            key_idx = torch.arange(ctx, device=q.device)
            query_idx = torch.arange(ctx - n, ctx, device=q.device)
            logits.masked_fill_(key_idx[None, :] > query_idx[:, None], float("-inf"))
            per_key = torch.softmax(logits, dim=-1).sum(dim=(0, 1))  # [ctx]
            padded = torch.nn.functional.pad(per_key, (0, self.sums[rid].numel() * bs - ctx))
            self.sums[rid] += padded.view(-1, bs).sum(dim=1)

    def to_lists(self) -> dict[str, list[float]]:
        return {rid: s.tolist() for rid, s in self.sums.items()}
