"""Token-tree verification in one forward pass equals decoding each tree path separately: with the tree mask (a
node sees the cached prefix and its ancestors only), RoPE positions by depth and consecutive cache slots, every
node's hidden state equals the one plain decoding of its path gives, on the reference and the CPU attention
backends; after ``compact_kv`` the accepted path's KV sits where plain decoding would have written it."""
from __future__ import annotations

import json

import pytest
import torch

from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
from rooflm.spec_decode.tree import TreeShape, attention_mask, compact_kv

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
BS = 4  # small blocks: the tree spans several


def _run(model, cfg, caches, blocks, computed: int, ids: list[int], positions: list[int] | None = None,
         tree: torch.Tensor | None = None) -> torch.Tensor:
    meta, pos = build_attention_metadata([blocks], [computed], [len(ids)], BS, "cpu")
    if tree is not None:
        meta.tree_masks = [tree]
        pos = torch.tensor(positions)
    with torch.inference_mode():
        return model(torch.tensor(ids), pos, caches, meta)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tree_attention_equals_sequential_decoding_of_each_path(tmp_path, backend):
    from rooflm.loader import load_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    model, cfg = load_model(str(path), load_format="dummy", dtype=torch.float32, device="cpu", show_progress=False,
                            attn_backend=backend, seed=5)
    shape = TreeShape.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 64, (10,), generator=g).tolist()
    root = 17
    tokens = torch.randint(3, 64, (shape.num_nodes,), generator=g).tolist()
    blocks = list(range(8))
    geometry = (cfg.num_hidden_layers, 8, BS, cfg.num_key_value_heads, cfg.head_dim)

    caches = allocate_kv_caches(*geometry)
    _run(model, cfg, caches, blocks, 0, prefix)
    p0 = len(prefix)
    hidden = _run(model, cfg, caches, blocks, p0, [root] + tokens, [p0] + [p0 + d for d in shape.depths],
                  attention_mask(shape.parents))  # [T + 1, H]

    def ancestors(node: int) -> list[int]:
        chain = []
        while node:
            chain.append(node)
            node = shape.parents[node - 1]
        return chain[::-1]

    for node in range(shape.num_nodes + 1):
        seq = [root] + [tokens[j - 1] for j in ancestors(node)]
        ref_caches = allocate_kv_caches(*geometry)
        ref = _run(model, cfg, ref_caches, blocks, 0, prefix + seq)[-1]
        torch.testing.assert_close(hidden[node], ref, rtol=1e-4, atol=1e-4)

    # Accept the path root -> node 2 -> node 5 (depths 1, 2): its KV moves to slots p0 + 1, p0 + 2.
    accepted = [2, 5]
    assert ancestors(5) == accepted
    compact_kv(caches, blocks, BS, p0, accepted)
    ref_caches = allocate_kv_caches(*geometry)
    _run(model, cfg, ref_caches, blocks, 0, prefix + [root] + [tokens[j - 1] for j in accepted])
    n = p0 + 1 + len(accepted)
    for got, want in zip(caches, ref_caches):
        flat_got, flat_want = got.view(2, -1, *got.shape[3:]), want.view(2, -1, *want.shape[3:])
        torch.testing.assert_close(flat_got[:, :n], flat_want[:, :n], rtol=1e-4, atol=1e-4)
