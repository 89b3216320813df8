"""How weights and heads are split over tensor-parallel ranks (no processes: pure functions)."""
from __future__ import annotations

import pytest
import torch

from rooflm.config import ModelConfig
from rooflm.distributed.partition import (Shard, check_tensor_parallel, expert_range, head_shard, narrow_packed,
                                          shard_model_config, shard_range, split_sizes)
from rooflm.quantization.packed import PackedWeight, dequantize, pack_int4


@pytest.mark.parametrize("n,parts", [(9, 2), (1536, 2), (49152, 3), (7, 7), (130, 4)])
def test_split_sizes_tile_the_range(n, parts):
    sizes = split_sizes(n, parts)
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    starts = [shard_range(n, parts, r)[0] for r in range(parts)]
    assert starts == [sum(sizes[:r]) for r in range(parts)]


@pytest.mark.parametrize("heads,kv,tp", [(9, 3, 2), (9, 3, 3), (32, 8, 4), (32, 8, 8), (4, 1, 2), (8, 2, 4),
                                         (32, 8, 3), (40, 40, 2), (64, 8, 16)])
def test_head_shards_cover_every_query_head_once_with_its_kv_head(heads, kv, tp):
    group = heads // kv
    seen = []
    for rank in range(tp):
        hs = head_shard(heads, kv, tp, rank)
        q = range(hs.q_start, hs.q_start + hs.num_heads)
        seen += q
        # every query head of this rank reads a KV head the same rank holds, at the same local grouping
        assert all(hs.kv_start <= h // group < hs.kv_start + hs.num_kv_heads for h in q)
        assert hs.num_heads % hs.num_kv_heads == 0
        local_group = hs.num_heads // hs.num_kv_heads
        assert all((h - hs.q_start) // local_group == h // group - hs.kv_start for h in q)
    assert seen == list(range(heads))


def _cfg(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", model_type="llama", vocab_size=128, hidden_size=64,
                intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return ModelConfig(**{**base, **kw})


def test_shard_model_config_gives_the_rank_its_heads():
    cfg = _cfg(num_attention_heads=9, num_key_value_heads=3)
    assert [(c.num_attention_heads, c.num_key_value_heads) for c in
            (shard_model_config(cfg, 2, r) for r in range(2))] == [(6, 2), (3, 1)]
    assert shard_model_config(cfg, 1, 0) is cfg


@pytest.mark.parametrize("kw,tp", [(dict(num_attention_heads=4, num_key_value_heads=2), 3),
                                   (dict(num_attention_heads=6, num_key_value_heads=1), 4)])
def test_unsplittable_models_are_refused_naming_the_field(kw, tp):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_tensor_parallel(_cfg(**kw), tp)


def test_experts_split_whole_over_the_expert_parallel_ranks_or_are_refused():
    moe = _cfg(num_local_experts=8, num_experts_per_tok=2, num_attention_heads=12, num_key_value_heads=12)
    check_tensor_parallel(moe, 4, expert_parallel=True)
    assert [expert_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    check_tensor_parallel(moe, 3)  # without expert parallelism each rank takes a slice of every expert
    with pytest.raises(ValueError, match="enable_expert_parallel=True with tensor_parallel_size=3"):
        check_tensor_parallel(moe, 3, expert_parallel=True)


def test_shard_model_config_under_tensor_and_pipeline_parallelism():
    cfg = _cfg(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    got = [shard_model_config(cfg, 2, tp_rank, 2, pp_rank) for pp_rank in range(2) for tp_rank in range(2)]
    assert [(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) for c in got] == [
        (2, 2, 1), (2, 2, 1), (1, 2, 1), (1, 2, 1)]


def _packed(bits: int, n: int = 6, k: int = 64, group: int = 16, perm: bool = False) -> PackedWeight:
    g = torch.Generator().manual_seed(bits)
    hi = 16 if bits == 4 else 256
    q = torch.randint(0, hi, (n, k), generator=g)
    qweight = pack_int4(q) if bits == 4 else (q - 128).to(torch.int8)
    scales = torch.rand(n, k // group, generator=g) + 0.1
    mins = torch.randn(n, k // group, generator=g)
    return PackedWeight(qweight, scales, mins, bits, group, torch.randperm(k, generator=g) if perm else None)


@pytest.mark.parametrize("bits", [4, 8])
def test_row_cut_of_a_packed_weight_stays_packed_and_exact(bits):
    pw = _packed(bits)
    part = narrow_packed(pw, Shard(0, 2, 3))
    assert isinstance(part, PackedWeight) and part.out_features == 3
    assert torch.equal(dequantize(part), dequantize(pw)[2:5])


@pytest.mark.parametrize("bits", [4, 8])
def test_column_cut_on_group_boundaries_stays_packed_and_exact(bits):
    pw = _packed(bits)
    part = narrow_packed(pw, Shard(1, 16, 32))
    assert isinstance(part, PackedWeight) and part.in_features == 32 and part.qweight.is_contiguous()
    assert torch.equal(dequantize(part), dequantize(pw)[:, 16:48])


@pytest.mark.parametrize("shard,perm", [(Shard(1, 8, 32), False), (Shard(1, 16, 32), True)])
def test_column_cut_across_groups_or_permuted_falls_back_to_float(shard, perm):
    pw = _packed(4, perm=perm)
    part = narrow_packed(pw, shard)
    assert isinstance(part, torch.Tensor)
    assert torch.equal(part, dequantize(pw, dtype=torch.float32).narrow(1, shard.start, shard.size))


def test_zero_shard_loads_zeros_of_the_shape():
    from rooflm.distributed.partition import narrow_weight

    assert torch.equal(narrow_weight(torch.arange(4.0) + 1, Shard(zero=True)), torch.zeros(4))
    assert torch.equal(narrow_weight(_packed(8), Shard(zero=True)), torch.zeros(6, 64))


def test_the_roofline_prices_an_uneven_split_as_rank_0s_share():
    """The analyzer splits a model only evenly; an engine split unevenly (SmolLM2's 9 heads and 3 KV heads over two
    ranks) is priced as rank 0's share, the largest: its heads, MLP columns and vocabulary rows, as a model of its
    own."""
    from rooflm.config import load_model_config
    from rooflm.distributed.partition import head_shard, roofline_share, shard_range

    even = load_model_config("llama-2-7b")
    assert roofline_share(even, 2) == (even, 2)
    cfg = load_model_config("smollm2-135m")
    share, tp = roofline_share(cfg, 2)
    hs = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, 2, 0)
    assert tp == 1 and (share.num_attention_heads, share.num_key_value_heads) == (hs.num_heads, hs.num_kv_heads)
    assert share.num_attention_heads < cfg.num_attention_heads and share.head_dim == cfg.head_dim
    assert share.intermediate_size == shard_range(cfg.intermediate_size, 2, 0)[1] == 768
    assert share.vocab_size == shard_range(cfg.vocab_size, 2, 0)[1] < cfg.vocab_size
    assert (share.hidden_size, share.num_hidden_layers) == (cfg.hidden_size, cfg.num_hidden_layers)
