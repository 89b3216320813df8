"""Launch decisions and inputs of paged decode attention (``rooflm.kernels.decode_attention``) that need no Triton:
the plan chosen from the batch shape, and the step's own token when the kernel rotates and writes it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rooflm.kernels._utils import check_last_dim_contiguous


@dataclass(frozen=True)
class NewTokenKV:
    """The step's own token handed to decode attention unrotated: the kernel rotates q and ``k`` (RoPE, rotate_half
    layout), writes ``k`` and ``v`` into the cache at ``slot_mapping`` (-1: not written) and attends to them from
    registers, so the separate rotary + cache-write kernel is not launched (one launch and one round trip of the
    step's token less per layer; TensorRT-LLM's masked multi-head attention kernel does the same). Bit-equal to
    ``rotary_write_kv_cache`` followed by the plain call: the same float32 expressions, rounded the same way."""
    k: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    cos: torch.Tensor  # [num_seqs, rot_dim // 2]: row i is sequence i's last position's angles
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [num_seqs] int64


@dataclass(frozen=True)
class DecodePlan:
    """Launch shape of one decode-attention call: split count, inner loop, tile, and whether the last split program
    of each (sequence, KV head) combines the partials itself instead of a second kernel."""
    num_splits: int
    use_dot: bool
    block_n: int
    num_warps: int
    num_stages: int
    fused_reduce: bool = False


def default_plan(num_seqs: int, num_kv_heads: int, group: int, num_sms: int, max_splits: int = 32) -> DecodePlan:
    """Depends on the batch shape only, so a captured CUDA graph keeps it for every context length. Measured on an
    H100 (Llama-2-7B heads, CUDA-graph replays over caches larger than the L2):
    - at least 2 (sequence, KV head) programs per multiprocessor: one program per pair, no split, tl.dot tiles of 64
      tokens with the K/V loads software-pipelined (cp.async): 180 us at batch 32 MHA, 1k tokens (the dot-free loop
      has no pipelining and measured 191 us);
    - small MHA batches (fewer than 2 programs per multiprocessor unsplit): the dot-free loop in one-warp programs
      over 16-token tiles, split until there are about 10 programs per multiprocessor (32 splits at batch 1: 11.6 us
      for 16 MiB against 12.3-16 us for 2- or 4-warp programs, 32-64 token tiles or 8-16 splits), the partials
      combined by the last split program of each head (no second launch). With the step's token rotated and written
      by the kernel (CUDA-graph replays on an H200, 1k tokens unless noted): batch 1, 32 splits, combined in the
      kernel against a reduce kernel: 20 heads 9.56 against 10.87 us, 32 heads 10.49 against 11.46 us, 40 heads
      11.72 against 12.77 us; batch 4 x 32 heads, 12 splits: 24.4 us against more than 27 us for the tl.dot plan
      and its separate rotary kernel (4k tokens: 70.7 against 74.9 us), batch 8 x 32 heads, 6 splits: 39.7 against
      44.0 us (4k: 133.5 against 137.5 us), batch 4 x 40 heads, 8 splits: 29.3 against 32.6 us; at batch 16 x 32
      heads (2 programs per multiprocessor) the two tie (71.0 us);
    - small GQA batches: tl.dot over 32-token tiles, 4 warps, 3 pipeline stages, about 4 programs per multiprocessor
      (32 splits at batch 1, 4k tokens: 12.0 us against 12.3-13.5 us for 16-24 splits or 64-token tiles)."""
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= 2 * num_sms:
        return DecodePlan(1, True, 64, 4, 2)
    if group == 1:
        return DecodePlan(min(max_splits, math.ceil(10 * num_sms / programs)), False, 16, 1, 2, fused_reduce=True)
    return DecodePlan(max(1, min(max_splits, math.ceil(4 * num_sms / programs))), True, 32, 4, 3)


def check_new_kv(nk: NewTokenKV, num_seqs: int, num_kv_heads: int, head_dim: int, quant: bool) -> None:
    if quant:
        raise ValueError("new_kv needs a float16 / bfloat16 / float32 cache; a quantized cache is written by "
                         "rotary_write_kv_cache")
    for name, t in (("new_kv.k", nk.k), ("new_kv.v", nk.v)):
        if tuple(t.shape) != (num_seqs, num_kv_heads, head_dim):
            raise ValueError(f"{name} {tuple(t.shape)} != {(num_seqs, num_kv_heads, head_dim)}")
        check_last_dim_contiguous(name, t)
    half = nk.cos.shape[-1] if nk.cos.dim() == 2 else -1
    if nk.cos.shape != nk.sin.shape or nk.cos.shape[0] < num_seqs or not 0 < 2 * half <= head_dim:
        raise ValueError(f"new_kv.cos/sin {tuple(nk.cos.shape)} / {tuple(nk.sin.shape)} do not fit {num_seqs} "
                         f"sequences of head_dim={head_dim}")
    check_last_dim_contiguous("new_kv.cos", nk.cos)
    check_last_dim_contiguous("new_kv.sin", nk.sin)
    if nk.sin.stride(0) != nk.cos.stride(0):  # the kernel steps both by cos's row stride
        raise ValueError(f"new_kv.cos/sin row strides differ: {nk.cos.stride(0)} / {nk.sin.stride(0)}")
    if nk.slot_mapping.shape != (num_seqs,):
        raise ValueError(f"new_kv.slot_mapping {tuple(nk.slot_mapping.shape)} != ({num_seqs},)")


def fuses_new_token(num_seqs: int, num_kv_heads: int, group: int, num_sms: int) -> bool:
    """Whether decode attention should take the step's token itself (``NewTokenKV``) for this batch shape: where the
    default plan is the dot-free loop (MHA, small batches). Measured on an H100 (``python -m rooflm.kernels.bench
    --sections decode_rope``, CUDA-graph replays, per layer): the dot-free plans saved 1.2-4.9 us a layer, most of
    what the rotary + cache-write kernel costs there (batch 1-2, 20-40 heads, 1k-4k tokens); the tl.dot plans gained
    0.7-1.6 us at a few shapes (GQA at batch 1) and lost up to 78 us at others (the software-pipelined loops of
    large batches and long contexts slow down with the branch for the owner's last tile)."""
    return not default_plan(num_seqs, num_kv_heads, group, num_sms).use_dot

