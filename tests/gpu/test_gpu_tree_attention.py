"""The tree-masked prefill/extend kernel and the Triton backend's tree steps on CUDA against the torch reference, at
realistic sizes: Llama-like heads, long cached contexts, Medusa-sized trees (16 and 64 query tokens) beside long
prefill chunks, fp16 and bf16. Skipped without CUDA."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tree_checks import check_tree_backend, check_tree_prefill, run_tree_prefill  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
# trees on sequences 0, 2 and 3 (15, 63 and 5 nodes after 700, 33 and 1500 cached tokens); 1 is a 300-token prefill
CTX, QLEN, TREES = [700, 0, 33, 1500], [16, 300, 64, 6], [0, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64), (16, 16, 64)])
def test_tree_prefill_mixed_batch(dtype, num_heads, num_kv_heads, head_dim):
    check_tree_prefill(num_heads, num_kv_heads, head_dim, 16, CTX, QLEN, TREES, dtype=dtype, device=DEV,
                       seed=num_heads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_only_batch_and_window(dtype):
    # every sequence a tree of at most 16 tokens (the small-query tiling), then a window shorter than the trees
    check_tree_prefill(32, 8, 128, 16, [100, 257, 31], [16, 8, 16], [0, 1, 2], dtype=dtype, device=DEV, seed=1)
    check_tree_prefill(32, 8, 128, 16, [100, 257, 0], [16, 40, 9], [0, 1], window=8, dtype=dtype, device=DEV, seed=2)


def test_tree_mask_not_lower_triangular():
    check_tree_prefill(32, 8, 128, 16, [90, 0], [100, 40], [0, 1], device=DEV, seed=3, shape="any")


def test_tree_int8_and_fp8_cache():
    for kv in ("int8", "fp8"):
        check_tree_prefill(32, 8, 128, 16, CTX, QLEN, TREES, device=DEV, seed=4, kv_cache_dtype=kv)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chain_tree_equals_causal_attention_up_to_rounding(dtype):
    out, _, plain, _ = run_tree_prefill(32, 8, 128, 16, [700, 5], [64, 16], [0, 1], dtype=dtype, device=DEV, seed=5,
                                        shape="chain")
    # the tree and the causal masks are compiled as two variants of the kernel, so the compiler may order the same
    # arithmetic differently: equal up to rounding (the CPU interpreter test asserts bit equality)
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    torch.testing.assert_close(out, plain, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 256])
def test_backend_tree_step_matches_reference(dtype, window):
    check_tree_backend(32, 8, 128, 16, [700, 3, 1200], [16, 200, 64], [0, 2], window=window, dtype=dtype, device=DEV,
                       seed=6)
