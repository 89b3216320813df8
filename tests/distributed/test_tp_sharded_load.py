"""Each rank loads only its shard, packed weights included: the shards of every rank tile the full model's weights.

The ranks are loaded one after the other in this process with the rank recorded as if a process group existed (no
collective runs: loading needs only the rank). The default GGUF (Q4_1 blocks, groups of 32) is kept quantized, so
the column cuts of the row-parallel o_proj (384 + 192 of 576 inputs) and down_proj (768 + 768) stay packed."""
from __future__ import annotations

import pytest
import torch

from rooflm.distributed import parallel_state as ps
from rooflm.loader import load_model
from rooflm.quantization.packed import dequantize

TP = 2


def _load_as_rank(monkeypatch, rank: int):
    state = ps.ParallelState(TP, rank, torch.device("cpu"), "gloo", None, None)
    monkeypatch.setattr(ps, "_STATE", state)
    try:
        with ps.building_sharded_model():
            return load_model(None, show_progress=False)[0]
    finally:
        monkeypatch.setattr(ps, "_STATE", None)


def _w(layer) -> torch.Tensor:
    return dequantize(layer.packed_weight, dtype=torch.float32) if layer.quantized else layer.weight.float()


@pytest.fixture(scope="module")
def full_and_shards():
    mp = pytest.MonkeyPatch()
    try:
        full = load_model(None, show_progress=False)[0]
        shards = [_load_as_rank(mp, r) for r in range(TP)]
    finally:
        mp.undo()
    return full, shards


def test_row_parallel_projections_stay_packed_and_tile_the_columns(full_and_shards):
    full, shards = full_and_shards
    for i in (0, len(full.model.layers) - 1):
        f = full.model.layers[i]
        s = [m.model.layers[i] for m in shards]
        for proj in ("o_proj",):
            parts = [getattr(x.self_attn, proj) for x in s]
            assert all(p.quant == "packed" for p in parts)
            assert [p.in_features for p in parts] == [384, 192]
            assert torch.equal(torch.cat([_w(p) for p in parts], dim=1), _w(getattr(f.self_attn, proj)))
        downs = [x.mlp.down_proj for x in s]
        assert all(p.quant == "packed" for p in downs)
        assert torch.equal(torch.cat([_w(p) for p in downs], dim=1), _w(f.mlp.down_proj))


def test_column_parallel_projections_hold_their_heads_and_columns(full_and_shards):
    full, shards = full_and_shards
    hd = full.config.head_dim
    f = full.model.layers[0]
    fq, fk, fv = _w(f.self_attn.qkv_proj).split([9 * hd, 3 * hd, 3 * hd])
    fg, fu = _w(f.mlp.gate_up_proj).chunk(2)
    qs, ks, vs, gs, us = [], [], [], [], []
    for m in shards:
        a = m.model.layers[0].self_attn
        q, k, v = _w(a.qkv_proj).split([a.q_size, a.kv_size, a.kv_size])
        qs.append(q), ks.append(k), vs.append(v)
        g, u = _w(m.model.layers[0].mlp.gate_up_proj).chunk(2)
        gs.append(g), us.append(u)
    for parts, whole in ((qs, fq), (ks, fk), (vs, fv), (gs, fg), (us, fu)):
        assert torch.equal(torch.cat(parts), whole)


def test_vocab_parallel_embedding_and_tied_head_tile_the_vocabulary(full_and_shards):
    full, shards = full_and_shards
    assert torch.equal(torch.cat([m.model.embed_tokens.weight for m in shards]), full.model.embed_tokens.weight)
    assert [m.lm_head.out_features for m in shards] == [full.config.vocab_size // TP] * TP
    assert torch.equal(torch.cat([_w(m.lm_head) for m in shards]), _w(full.lm_head))
