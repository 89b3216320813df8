"""Which part of each weight a tensor-parallel rank holds, and how a checkpoint tensor is cut to that part.

Megatron-style partitioning (Shoeybi et al. 2019):

- column-parallel (``qkv_proj``, ``gate_up_proj``, the LM head): each rank holds a range of output rows, computes its
  slice of the output, and needs no communication (the LM head gathers its vocabulary slices: every rank samples
  from the full logits);
- row-parallel (``o_proj``, ``down_proj``): each rank holds the input columns matching its slice of the previous
  output and computes a partial sum; one all-reduce adds them up;
- vocab-parallel embedding: each rank holds a range of token rows, looks up the ids in its range (zeros elsewhere),
  and an all-reduce adds the ranks' rows.

Mixture-of-experts layers (Mixtral) split each expert like a dense MLP (a slice of its intermediate columns on every
rank), or, under expert parallelism, give each rank ``num_experts / tp`` whole experts (a contiguous range,
``expert_range``); the router stays whole on every rank either way.

Attention heads are split by KV-head group, so every query head finds its KV head on its own rank. When a dimension
does not split evenly (SmolLM2-135M has 9 query heads and 3 KV heads), the first ranks get one unit more: with 2 ranks
rank 0 holds 2 KV heads (6 query heads) and rank 1 holds 1 (3). With more ranks than KV heads, each KV head is
replicated on ``tp / num_kv_heads`` ranks, which then split its query heads evenly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rooflm.config import ModelConfig
from rooflm.quantization.packed import PackedWeight, dequantize


def split_sizes(n: int, parts: int) -> list[int]:
    """``n`` units over ``parts`` ranks as evenly as possible, the first ranks taking the remainder."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of rank ``index``'s share of ``n`` units (``split_sizes``)."""
    sizes = split_sizes(n, parts)
    return sum(sizes[:index]), sizes[index]


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_start, q_start + num_heads), KV heads
    [kv_start, kv_start + num_kv_heads)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def check_tensor_parallel(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """ValueError naming ``tensor_parallel_size`` (and ``enable_expert_parallel``) when ``cfg`` cannot be split over
    ``tp`` ranks."""
    if tp == 1:
        return
    if cfg.is_moe and expert_parallel and cfg.num_local_experts % tp:
        raise ValueError(f"enable_expert_parallel=True with tensor_parallel_size={tp} is invalid for "
                         f"{cfg.name or cfg.architecture}: its num_local_experts={cfg.num_local_experts} do not split "
                         "evenly over the ranks (use a tensor_parallel_size that divides them, or turn expert "
                         "parallelism off)")
    kv, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    if tp > kv and (tp % kv or heads % tp):
        raise ValueError(f"tensor_parallel_size={tp} is invalid for {cfg.name or cfg.architecture}: with more ranks "
                         f"than its {kv} KV heads, tensor_parallel_size must be a multiple of them and divide its "
                         f"{heads} attention heads")
    if tp > min(cfg.intermediate_size, cfg.vocab_size):
        raise ValueError(f"tensor_parallel_size={tp} exceeds the model's intermediate size or vocabulary")


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    """The heads rank ``rank`` of ``tp`` holds (see the module docstring)."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if tp <= num_kv_heads:
        kv_start, kv_n = shard_range(num_kv_heads, tp, rank)
        return HeadShard(kv_start * group, kv_n * group, kv_start, kv_n)
    per_rank = num_heads // tp
    q_start = rank * per_rank
    return HeadShard(q_start, per_rank, q_start // group, 1)


def expert_range(num_experts: int, ep: int, rank: int) -> tuple[int, int]:
    """(first expert, count) of the whole experts expert-parallel rank ``rank`` of ``ep`` holds (``check_tensor_
    parallel`` makes sure they split evenly)."""
    return shard_range(num_experts, ep, rank)


def shard_model_config(cfg: ModelConfig, tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0) -> ModelConfig:
    """``cfg`` with the head counts (tensor parallelism) and the decoder layers (pipeline parallelism) of one rank:
    what its KV cache holds. Everything else unchanged."""
    if pp > 1:
        cfg = dataclasses.replace(cfg, num_hidden_layers=shard_range(cfg.num_hidden_layers, pp, pp_rank)[1])
    if tp == 1:
        return cfg
    hs = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, tp, tp_rank)
    return dataclasses.replace(cfg, num_attention_heads=hs.num_heads, num_key_value_heads=hs.num_kv_heads)


def roofline_share(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> tuple[ModelConfig, int]:
    """What the roofline prices for one tensor-parallel rank, as (model, tp) for ``rooflm.roofline``: the model with
    ``tp`` where the analyzer can split it evenly, else (an uneven split, such as 9 heads over 2 ranks) rank 0's
    share, the largest, as a model of its own: its query and KV heads, its MLP columns and its vocabulary rows."""
    from rooflm.roofline.ops import Dims

    try:
        Dims.of(cfg, tp, expert_parallel)
        return cfg, tp
    except ValueError:
        hs = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, tp, 0)
        return dataclasses.replace(cfg, num_attention_heads=hs.num_heads, num_key_value_heads=hs.num_kv_heads,
                                   intermediate_size=shard_range(cfg.intermediate_size, tp, 0)[1],
                                   vocab_size=shard_range(cfg.vocab_size, tp, 0)[1]), 1


def check_pipeline_parallel(cfg: ModelConfig, pp: int) -> None:
    """ValueError naming ``pipeline_parallel_size`` when ``cfg`` cannot be split into ``pp`` stages."""
    if pp == 1:
        return
    if cfg.is_moe:
        raise ValueError(f"pipeline_parallel_size={pp}: mixture-of-experts models ({cfg.architecture}) run on one "
                         "rank only for now")
    if pp > cfg.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the {cfg.num_hidden_layers} decoder layers of "
                         f"{cfg.name or cfg.architecture}")


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor a rank loads: ``size`` entries from ``start`` along ``dim`` (0: rows,
    1: columns). ``zero``: zeros of the tensor's shape instead (the bias of a row-parallel projection on every rank
    but the first: the all-reduce that sums the ranks' outputs then adds it once)."""

    dim: int = 0
    start: int = 0
    size: int = 0
    zero: bool = False


def narrow_tensor(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    if shard.zero:
        return torch.zeros_like(tensor)
    return tensor.narrow(shard.dim, shard.start, shard.size)


def narrow_packed(pw: PackedWeight, shard: Shard) -> PackedWeight | torch.Tensor:
    """The rank's part of a quantized weight, still packed when the cut follows the layout: any row range, or a
    column range on group boundaries (and on byte boundaries for 4-bit codes) of a weight without an act-order
    permutation. Otherwise the dequantized float part (the layer then stays float)."""
    if shard.zero:
        return torch.zeros(pw.out_features, pw.in_features, dtype=torch.float32)
    if shard.dim == 0:
        end = shard.start + shard.size
        return dataclasses.replace(pw, qweight=pw.qweight[shard.start:end].contiguous(),
                                   scales=pw.scales[shard.start:end].contiguous(),
                                   mins=None if pw.mins is None else pw.mins[shard.start:end].contiguous(),
                                   mma=None)
    g = pw.group_size
    if pw.perm is None and shard.start % g == 0 and shard.size % g == 0:
        per_byte = 2 if pw.bits == 4 else 1
        groups = slice(shard.start // g, (shard.start + shard.size) // g)
        cols = slice(shard.start // per_byte, (shard.start + shard.size) // per_byte)
        return dataclasses.replace(pw, qweight=pw.qweight[:, cols].contiguous(),
                                   scales=pw.scales[:, groups].contiguous(),
                                   mins=None if pw.mins is None else pw.mins[:, groups].contiguous(), mma=None)
    return dequantize(pw, dtype=torch.float32).narrow(1, shard.start, shard.size)


def narrow_weight(tensor: torch.Tensor | PackedWeight, shard: Shard) -> torch.Tensor | PackedWeight:
    """The part of a checkpoint tensor (float or packed) that ``shard`` names."""
    if isinstance(tensor, PackedWeight):
        return narrow_packed(tensor, shard)
    return narrow_tensor(tensor, shard)
