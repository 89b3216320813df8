"""Fresh prompts through PyTorch's fused attention (``rooflm/attention/dense_prefill.py``) against the paged Triton
kernel and the torch reference on the same step: several sequences of uneven lengths, GQA, float16 and bfloat16;
and the steps that must keep the paged kernel (a sequence with cached context, a quantized cache, a token tree, a
sliding window, more sequences than MAX_SEQS, too few tokens)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from rooflm.attention import dense_prefill  # noqa: E402
from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata  # noqa: E402
from rooflm.attention.torch_ref import TorchRefAttention  # noqa: E402
from rooflm.attention.triton_backend import TritonAttention  # noqa: E402

pytestmark = pytest.mark.gpu
BS = 16


def _step(lens, computed, heads, kv_heads, d, dtype, kv_cache_dtype="auto", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks, nxt = [], 0
    for n, c in zip(lens, computed):
        nb = -(-(n + c) // BS)
        blocks.append(list(range(nxt, nxt + nb)))
        nxt += nb
    meta, _ = build_attention_metadata(blocks, computed, lens, BS, "cuda")
    cache = allocate_kv_caches(1, nxt + 1, BS, kv_heads, d, dtype, "cuda", kv_cache_dtype)[0]
    t = sum(lens)
    q = torch.randn(t, heads, d, generator=g, device="cuda").to(dtype)
    k = torch.randn(t, kv_heads, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(t, kv_heads, d, generator=g, device="cuda").to(dtype)
    ones, zeros = torch.ones(t, d // 2, device="cuda", dtype=dtype), torch.zeros(t, d // 2, device="cuda", dtype=dtype)
    TritonAttention().rotary_and_write(q, k, v, ones, zeros, cache, meta)  # cos 1, sin 0: k, v written as they are
    return q, k, v, cache, meta


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("lens", [[70, 133, 5, 64], [150]])
def test_fresh_prompts_equal_the_paged_kernel_and_the_reference(dtype, heads, kv_heads, d, lens):
    q, k, v, cache, meta = _step(lens, [0] * len(lens), heads, kv_heads, d, dtype)
    assert dense_prefill.usable(q, cache, meta, None)
    scale = d ** -0.5
    fused = TritonAttention().attend(q, cache, meta, scale, None, k, v)
    paged = TritonAttention().attend(q, cache, meta, scale, None)  # without k, v: the paged kernel
    ref = TorchRefAttention().attend(q.float(), cache.float(), meta, scale, None)
    assert fused.shape == q.shape and fused.dtype == dtype and fused.is_contiguous() and torch.isfinite(fused).all()
    tol = 4e-3 if dtype == torch.float16 else 2e-2
    assert _rel(fused, ref) < tol and _rel(paged, ref) < tol
    assert not torch.equal(fused, paged)  # two kernels really ran


def test_steps_the_fused_call_does_not_take_keep_the_paged_kernel():
    q, k, v, cache, meta = _step([70, 80], [0, 32], 4, 4, 64, torch.float16)
    assert not dense_prefill.usable(q, cache, meta, None)  # the second sequence has 32 cached tokens
    q, k, v, cache, meta = _step([70, 80], [0, 0], 4, 4, 64, torch.float16, kv_cache_dtype="int8")
    assert not dense_prefill.usable(q, cache, meta, None)
    q, k, v, cache, meta = _step([70, 80], [0, 0], 4, 4, 64, torch.float16)
    assert dense_prefill.usable(q, cache, meta, None)
    meta.tree_masks = [None, torch.ones(80, 80, dtype=torch.bool, device="cuda").tril()]
    assert not dense_prefill.usable(q, cache, meta, None)
    assert not dense_prefill.usable(q, cache, meta, 32)  # a sliding window
    q, k, v, cache, meta = _step([20, 10], [0, 0], 4, 4, 64, torch.float16)
    assert not dense_prefill.usable(q, cache, meta, None)  # fewer tokens than MIN_TOKENS
    q, k, v, cache, meta = _step([30] * 5, [0] * 5, 4, 4, 64, torch.float16)
    assert not dense_prefill.usable(q, cache, meta, None)  # more sequences than MAX_SEQS
