"""Token-tree masks packed for the Triton prefill/extend kernel (``rooflm.kernels.prefill_attention``).

``AttentionMetadata.tree_masks`` holds, per sequence, None (causal) or the [Q, Q] bool mask of its Q new tokens (a
token tree's root and nodes, ``rooflm.spec_decode.tree.attention_mask``). The kernel reads them as two device
tensors: ``offsets`` [num_seqs] int32, the start of sequence i's row-major [Q_i, Q_i] block in ``data`` or -1 for a
causal sequence, and ``data`` int8 (1: may attend), the blocks one after the other. A block per tree sequence (rather
than a row per query token) keeps plain sequences of the same batch, long prefill chunks among them, free, and fits
trees of any size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedTreeMasks:
    offsets: torch.Tensor  # [num_seqs] int32: where sequence i's block starts in ``data``; -1: causal
    data: torch.Tensor  # [sum of Q_i * Q_i over the tree sequences] int8, row-major [Q_i, Q_i] blocks


def pack_tree_masks(tree_masks: list[torch.Tensor | None], query_start_loc_cpu: list[int],
                    device: torch.device | str) -> PackedTreeMasks:
    """Pack per-sequence masks (None: causal) for a step whose sequence i has the new tokens
    ``query_start_loc_cpu[i]:[i + 1]``. Raises ValueError when a mask is not [Q_i, Q_i]."""
    num_seqs = len(query_start_loc_cpu) - 1
    if len(tree_masks) != num_seqs:
        raise ValueError(f"tree_masks has {len(tree_masks)} entries for {num_seqs} sequences")
    offsets: list[int] = []
    blocks: list[torch.Tensor] = []
    used = 0
    for i, mask in enumerate(tree_masks):
        if mask is None:
            offsets.append(-1)
            continue
        q_len = query_start_loc_cpu[i + 1] - query_start_loc_cpu[i]
        if tuple(mask.shape) != (q_len, q_len):
            raise ValueError(f"tree_masks[{i}] has shape {tuple(mask.shape)}: expected ({q_len}, {q_len}), one row and "
                             "column per new token of the sequence")
        offsets.append(used)
        used += q_len * q_len
        blocks.append(mask.reshape(-1).to(device=device, dtype=torch.int8))
    data = torch.cat(blocks) if blocks else torch.zeros(1, dtype=torch.int8, device=device)
    return PackedTreeMasks(torch.tensor(offsets, dtype=torch.int32).to(device), data)


def packed_tree_masks(meta) -> PackedTreeMasks | None:
    """The step's packed masks (None without trees), built on first use and kept on ``meta`` for the other layers."""
    if meta.tree_masks is None:
        return None
    if meta.tree_masks_packed is None:
        meta.tree_masks_packed = pack_tree_masks(meta.tree_masks, meta.query_start_loc_cpu, meta.query_start_loc.device)
    return meta.tree_masks_packed
