"""The tree-masked prefill/extend kernel (token-tree verification, SpecInfer / Medusa) against the torch reference,
under Triton's CPU interpreter without CUDA: random trees beside plain sequences, with cached context and GQA; a
chain-shaped tree is exactly causal attention; the Triton backend takes the kernel path for tree steps."""
import pytest
import torch

from tree_checks import check_tree_backend, check_tree_prefill, count_tree_kernel_calls, run_tree_prefill


# Sequence 0 and 2 verify trees (T = 5 and 8 nodes after 13 and 21 cached tokens); 1 is a plain prefill beside them.
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 1)])
def test_tree_prefill_mixed_batch(device, num_heads, num_kv_heads):
    check_tree_prefill(num_heads, num_kv_heads, 64, 8, [13, 0, 21], [6, 11, 9], [0, 2], device=device,
                       seed=num_kv_heads)


def test_tree_spanning_two_query_tiles_with_window(device):
    # 21 queries fill two of the interpreter's 16-row tiles; a window of 4 would skip the second tile's early new keys
    # if the tree's own keys followed the window rule (the reference applies the window to the cached context only)
    check_tree_prefill(4, 2, 64, 8, [30, 7], [21, 5], [0], window=4, device=device, seed=3)


def test_tree_mask_not_lower_triangular(device):
    # a mask may open keys after the query: the kernel scans every new key of a tree sequence, past the first 16-row
    # query tile's own keys too
    check_tree_prefill(2, 1, 64, 8, [9, 0], [20, 7], [0, 1], device=device, seed=4, shape="any")


def test_tree_bfloat16_and_int8_cache(device):
    check_tree_prefill(4, 2, 64, 8, [10], [7], [0], dtype=torch.bfloat16, device=device, seed=5)
    check_tree_prefill(4, 2, 64, 8, [10, 3], [7, 4], [0], device=device, seed=6, kv_cache_dtype="int8")


def test_chain_tree_equals_causal_attention_exactly(device):
    # a chain (node j's parent is j - 1) sees exactly what causal attention sees; the extra key tiles a tree sequence
    # scans are fully masked and leave the online softmax unchanged
    out, ref, plain, masks = run_tree_prefill(4, 2, 64, 8, [5, 17], [20, 4], [0, 1], device=device, seed=7,
                                              shape="chain")
    assert all(torch.equal(m, torch.ones_like(m).tril()) for m in masks)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("window", [None, 6])
def test_backend_tree_step_matches_reference(device, window):
    check_tree_backend(4, 2, 64, 8, [11, 4, 0], [5, 1, 9], [0], window=window, device=device, seed=8)


def test_pack_tree_masks_rejects_bad_shapes():
    from rooflm.attention.tree_mask import pack_tree_masks

    eye = torch.eye(3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"tree_masks\[1\] has shape \(3, 3\)"):
        pack_tree_masks([None, eye], [0, 2, 6], "cpu")
    with pytest.raises(ValueError, match="tree_masks has 1 entries for 2 sequences"):
        pack_tree_masks([eye], [0, 3, 5], "cpu")


def test_pack_tree_masks_layout():
    from rooflm.attention.tree_mask import pack_tree_masks
    from rooflm.spec_decode.tree import attention_mask

    a, b = attention_mask([0, 0, 1]), attention_mask([0])
    packed = pack_tree_masks([a, None, b], [0, 4, 9, 11], "cpu")
    assert packed.offsets.tolist() == [0, -1, 16]
    assert packed.data.dtype == torch.int8
    assert torch.equal(packed.data[:16].view(4, 4).bool(), a)
    assert torch.equal(packed.data[16:].view(2, 2).bool(), b)


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "vocab_size": 64,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256}


def _tiny_model(tmp_path, backend: str, std: float = 0.02):
    """A 2-layer Llama on the CPU with dummy weights ~ normal(0, std) and the given attention backend."""
    import json

    from rooflm.loader import load_model
    from rooflm.loader.dummy import init_dummy_weights

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    model, cfg = load_model(str(path), load_format="dummy", dtype=torch.float32, device="cpu", show_progress=False,
                            attn_backend=backend)
    init_dummy_weights(model, seed=3, std=std)
    return model, cfg


@pytest.mark.skipif(torch.cuda.is_available(), reason="builds its models on the CPU for Triton's interpreter; on CUDA "
                    "tests/gpu/test_gpu_tree_attention.py and test_gpu_medusa.py check the same")
def test_model_tree_step_with_the_triton_backend_equals_decoding_each_path(tmp_path):
    # a tiny Llama verifies a token tree in one step through TritonAttention: every node's hidden state equals the one
    # plain decoding of its path gives (the reference backend, whole path as a prefill)
    from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
    from rooflm.spec_decode.tree import TreeShape, attention_mask, tree_depths

    models = {name: _tiny_model(tmp_path, name)[0] for name in ("triton", "torch")}
    shape = TreeShape.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 64, (9,), generator=g).tolist()
    tokens = [11] + torch.randint(3, 64, (shape.num_nodes,), generator=g).tolist()  # the root, then the nodes
    bs, blocks, geometry = 4, list(range(6)), (2, 6, 4, 2, 16)

    def run(model, caches, computed, ids, positions=None, tree=None):
        meta, pos = build_attention_metadata([blocks], [computed], [len(ids)], bs, "cpu")
        if tree is not None:
            meta.tree_masks, pos = [tree], torch.tensor(positions)
        with torch.inference_mode():
            return model(torch.tensor(ids), pos, caches, meta)

    caches = allocate_kv_caches(*geometry)
    run(models["triton"], caches, 0, prefix)
    p0 = len(prefix)
    hidden = run(models["triton"], caches, p0, tokens, tree_depths(shape.parents, p0), attention_mask(shape.parents))
    for node in range(shape.num_nodes + 1):
        path = [node]
        while path[-1]:
            path.append(shape.parents[path[-1] - 1])
        seq = [tokens[j] for j in reversed(path)]
        want = run(models["torch"], allocate_kv_caches(*geometry), 0, prefix + seq)[-1]
        torch.testing.assert_close(hidden[node], want, rtol=1e-4, atol=1e-4, msg=lambda m: f"node {node}: {m}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="builds its models on the CPU for Triton's interpreter; on CUDA "
                    "tests/gpu/test_gpu_tree_attention.py and test_gpu_medusa.py check the same")
def test_engine_medusa_tree_with_the_triton_backend_equals_plain_decoding(tmp_path, monkeypatch):
    # the engine path: the model runner's tree masks reach the Triton kernel, and greedy Medusa tokens with a wide
    # tree (12 candidates for the next token, so some are accepted even with random heads) equal plain decoding's.
    # Larger weights (std 0.3) keep the tiny model's output from collapsing into one repeated token, so a node's
    # attention to the wrong siblings changes the tokens.
    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine
    from rooflm.sampling_params import SamplingParams
    from rooflm.spec_decode.medusa import MedusaHeads, model_identity, save_medusa_heads

    calls = count_tree_kernel_calls(monkeypatch)
    heads = MedusaHeads(2, TINY["hidden_size"])
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=torch.Generator().manual_seed(0)) / 16)
    save_medusa_heads(heads, tmp_path / "heads", model_identity(_tiny_model(tmp_path, "torch")[1], "tiny"))
    tree = [[i] for i in range(12)] + [[0, 0], [1, 0], [2, 0], [0, 1]]
    prompts = [torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23, 40)]

    def generate(backend: str, spec: dict | None):
        model, cfg = _tiny_model(tmp_path, backend, std=0.3)
        engine = LLMEngine(EngineConfig(max_num_seqs=4, kv_cache_memory=8 * 2**20, max_model_len=128, device="cpu",
                                        dtype="float32", speculative_config=spec, show_progress=False),
                           model=model, model_config=cfg, tokenizer=None)
        for i, (p, m) in enumerate(zip(prompts, (9, 12, 15))):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
        return [done[str(i)] for i in range(len(prompts))], engine.get_stats()

    plain, _ = generate("torch", None)
    got, stats = generate("triton", {"method": "medusa", "model": str(tmp_path / "heads"), "num_speculative_tokens": 2,
                                     "tree": tree, "auto_disable": False})
    assert got == plain
    assert stats.spec_verifications > 0 and stats.spec_accepted_tokens > 0 and calls["tree"] > 0
