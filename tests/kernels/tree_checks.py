"""Token-tree checks shared by tests/kernels (CPU, Triton interpreter, small shapes) and tests/gpu (CUDA, larger
shapes): the tree-masked prefill/extend kernel and the Triton backend against the torch reference."""
from __future__ import annotations

import torch

from kernel_checks import TOL, assert_close, make_step, run_backend_and_reference


def random_parents(num_nodes: int, gen: torch.Generator) -> list[int]:
    """A random tree numbered so that parents come first (as ``spec_decode.tree`` numbers its nodes breadth-first):
    node j's parent is one of 0 (the root) .. j - 1."""
    return [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, num_nodes + 1)]


def random_masks(q_lens: list[int], tree_seqs: list[int], gen: torch.Generator, device: str,
                 shape: str = "tree") -> list[torch.Tensor | None]:
    """Per sequence: a [Q, Q] mask for those in ``tree_seqs``, None for the others. ``shape``: "tree" (a random token
    tree), "chain" (each node's parent is the previous one) or "any" (random bits plus the diagonal, keys after the
    query included: the kernel must not assume a lower-triangular mask)."""
    from rooflm.spec_decode.tree import attention_mask

    masks: list[torch.Tensor | None] = []
    for i, q_len in enumerate(q_lens):
        if i not in tree_seqs:
            masks.append(None)
        elif shape == "chain":
            masks.append(attention_mask(list(range(q_len - 1)), device))
        elif shape == "any":
            bits = (torch.rand(q_len, q_len, generator=gen) < 0.4) | torch.eye(q_len, dtype=torch.bool)
            masks.append(bits.to(device))
        else:
            masks.append(attention_mask(random_parents(q_len - 1, gen), device))
    return masks


def run_tree_prefill(num_heads, num_kv_heads, head_dim, block_size, ctx_lens, q_lens, tree_seqs, window=None,
                     dtype=torch.float16, device="cpu", seed=0, shape="tree", kv_cache_dtype="auto", tiles=None):
    """One random step through the kernel with tree masks on ``tree_seqs``. Returns (kernel output, reference output,
    kernel output with no masks at all, the masks)."""
    from rooflm.attention.tree_mask import pack_tree_masks
    from rooflm.kernels.kv_cache import write_kv_cache
    from rooflm.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

    g = torch.Generator().manual_seed(seed)
    q, k, v, cache, meta = make_step(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, g,
                                     kv_cache_dtype)
    masks = random_masks(q_lens, tree_seqs, g, device, shape)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    scale = head_dim ** -0.5
    args = (q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len, scale, window)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(*args, out=out, tiles=tiles, tree=pack_tree_masks(masks, meta.query_start_loc_cpu, device))
    plain = torch.full_like(q, float("nan"))
    paged_prefill_attention(*args, out=plain, tiles=tiles)
    ref = paged_prefill_attention_ref(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, window,
                                      tree_masks=masks)
    return out, ref, plain, masks


def check_tree_prefill(*args, **kw) -> None:
    out, ref, plain, _ = run_tree_prefill(*args, **kw)
    dtype = kw.get("dtype", torch.float16)
    assert_close(out, ref, dtype, f"tree prefill {args} {kw}")
    if kw.get("shape", "tree") != "chain":  # the masks were not all causal: the check would see a kernel ignore them
        assert not torch.allclose(out.float(), plain.float(), atol=TOL[dtype][0] * 10), "the tree masks changed nothing"



def check_tree_backend(num_heads, num_kv_heads, head_dim, block_size, ctx_lens, q_lens, tree_seqs, window=None,
                       dtype=torch.float16, device="cpu", seed=0) -> None:
    """TritonAttention against TorchRefAttention through rotary_and_write and attend, on a step whose ``tree_seqs``
    carry token-tree masks in ``AttentionMetadata.tree_masks`` (the way the model runner hands them over)."""
    from rooflm.attention.torch_ref import TorchRefAttention
    from rooflm.attention.triton_backend import TritonAttention

    g = torch.Generator().manual_seed(seed)
    q, k, v, cache, meta = make_step(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, g)
    meta.tree_masks = random_masks(q_lens, tree_seqs, g, device)
    scale = head_dim ** -0.5
    rq, out, _, ref, _ = run_backend_and_reference(TritonAttention(), q, k, v, cache, meta, scale, window, g)
    assert meta.tree_masks_packed is not None, "the Triton backend did not take the tree-masked kernel path"
    # the cache written by the backend, read by the reference: the attention alone
    assert_close(out, TorchRefAttention().attend(rq, cache, meta, scale, window), dtype, "tree backend attend")
    assert_close(out, ref, dtype, f"tree backend ctx={ctx_lens} q={q_lens} trees={tree_seqs} w={window}")


def count_tree_kernel_calls(monkeypatch) -> dict[str, int]:
    """Wrap the Triton backend's prefill kernel so a test can see that tree steps reach it with their masks:
    returns a dict whose ``"tree"`` counts the calls that carried masks."""
    import rooflm.attention.triton_backend as tb

    calls = {"tree": 0}
    kernel = tb.paged_prefill_attention

    def counting(*args, tree=None, **kw):
        calls["tree"] += tree is not None
        return kernel(*args, tree=tree, **kw)

    monkeypatch.setattr(tb, "paged_prefill_attention", counting)
    return calls

