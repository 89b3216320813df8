"""The kernel checks of tests/kernels on CUDA at realistic sizes (Llama-7B-like heads, long contexts)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kernel_checks import (  # noqa: E402
    assert_close, check_backend, check_decode, check_gemv, check_prefill, check_rmsnorm, check_rotary,
    check_silu_and_mul, check_write_kv,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
LENS = [1, 15, 16, 17, 255, 256, 257, 1023, 2049]  # odd lengths and block boundaries (block_size 16)


@pytest.mark.parametrize("num_kv_heads", [32, 8, 4])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode(num_kv_heads, window, num_splits):
    check_decode(32, num_kv_heads, 128, 16, LENS, window=window, num_splits=num_splits, device=DEV,
                 seed=num_kv_heads + (window or 0))


@pytest.mark.parametrize("lanes,use_dot", [(False, None), (True, None), (False, True)])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("window", [None, 256])
def test_decode_mha_inner_loops(lanes, use_dot, pdl, window):
    for num_splits, block_n, warps in ((1, 64, 4), (16, 32, 2), (37, 16, 1)):
        _decode_opts(32, 32, LENS, window=window, lanes=lanes, use_dot=use_dot, pdl=pdl, num_splits=num_splits,
                     block_n=block_n, num_warps=warps)


def _decode_opts(num_heads, num_kv_heads, lens, window=None, dtype=torch.float16, **kw):
    from kernel_checks import make_paged

    from rooflm.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    cache, tables = make_paged(lens, num_kv_heads, 128, 16, dtype, DEV)
    q = torch.randn(len(lens), num_heads, 128, device=DEV, dtype=dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, tables, seq_lens, 128 ** -0.5, window, out=out, **kw)
    ref = paged_decode_attention_ref(q, cache, tables, seq_lens, 128 ** -0.5, window)
    assert_close(out, ref, dtype, f"decode {kw} w={window}")


@pytest.mark.parametrize("pdl,num_stages", [(False, 2), (True, 3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_gqa_pdl_and_stages(pdl, num_stages, dtype):
    for num_splits in (None, 8, 64):
        _decode_opts(32, 8, LENS + [0], dtype=dtype, pdl=pdl, num_stages=num_stages, num_splits=num_splits)


@pytest.mark.parametrize("fused_reduce", [True, False])
@pytest.mark.parametrize("block_n,num_splits", [(32, 24), (64, 16), (64, 40)])
def test_decode_reduce_paths_and_tiles(fused_reduce, block_n, num_splits):
    # repeated on fresh inputs: the fused (atomic-ticket) reduction must give the same answer every time
    for seed in range(5):
        check_decode(32, 8, 128, 16, LENS, num_splits=num_splits, fused_reduce=fused_reduce, block_n=block_n,
                     device=DEV, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (96, 16)])
def test_decode_dtypes_and_dims(dtype, head_dim, block_size):
    check_decode(16, 4, head_dim, block_size, [3, 700, 1500, 0], dtype=dtype, device=DEV)


@pytest.mark.parametrize("num_kv_heads", [32, 8, 4])
@pytest.mark.parametrize("ctx_lens,q_lens", [([0], [2048]), ([0, 100, 513, 16], [1, 300, 77, 129]), ([1000], [37])])
@pytest.mark.parametrize("window", [None, 256])
def test_prefill(num_kv_heads, ctx_lens, q_lens, window):
    check_prefill(32, num_kv_heads, 128, 16, ctx_lens, q_lens, window=window, device=DEV, seed=sum(q_lens))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_prefill_dtypes_and_dims(dtype, head_dim):
    check_prefill(8, 2, head_dim, 16, [0, 33], [300, 65], dtype=dtype, device=DEV)


@pytest.mark.parametrize("ctx_lens,q_lens", [([5, 16, 1031, 0], [1, 1, 1, 1]), ([0, 400], [700, 1]), ([64], [64])])
@pytest.mark.parametrize("window", [None, 128])
def test_backend(ctx_lens, q_lens, window):
    check_backend(32, 8, 128, 16, ctx_lens, q_lens, window=window, device=DEV, seed=len(ctx_lens))


def test_write_kv_and_rotary():
    check_write_kv(300, 8, 128, device=DEV)
    for neox in (True, False):
        check_rotary(64, 32, 8, 128, 128, neox, True, device=DEV)
        check_rotary(5, 32, 32, 128, 64, neox, True, device=DEV)
    check_rotary(33, 32, 8, 128, 128, True, True, device=DEV, per_token=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_and_activation(dtype):
    for residual in (False, True):
        check_rmsnorm(37, 4096, residual, dtype=dtype, device=DEV)
        check_rmsnorm(3, 5120, residual, dtype=dtype, device=DEV)
    check_silu_and_mul(37, 11008, dtype=dtype, device=DEV)


@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 11008), (1000, 777)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_candidates(n, k, dtype):
    from rooflm.kernels.gemv import CANDIDATES

    for cfg in CANDIDATES:
        for m in ([1] if not cfg.use_dot else [1, 2, 7, 16]):
            check_gemv(cfg, m, n, k, bias=(m == 2), dtype=dtype, device=DEV, seed=m)


def test_linear_dispatch_picks_and_matches():
    from rooflm.kernels import gemv

    for m in (1, 3, 16, 17):
        x = torch.randn(m, 4096, device=DEV, dtype=torch.float16)
        w = torch.randn(4096, 4096, device=DEV, dtype=torch.float16) / 64
        ref = torch.nn.functional.linear(x.double(), w.double())
        out = gemv.linear(x, w)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
    assert gemv.choices(), "the dispatcher recorded no choice"


@pytest.mark.parametrize("num_kv_heads", [8, 32])
@pytest.mark.parametrize("fused_reduce,pdl", [(False, False), (True, False), (False, True), (True, True)])
def test_decode_in_cuda_graph_replays_at_new_lengths(fused_reduce, pdl, num_kv_heads):
    """Capture decode attention once; replay with other contexts and lengths written into the static buffers (the
    fused reduction's tickets must be back at zero after every replay). pdl: programmatic dependent launch edges in
    the graph, after a kernel that writes q and the cache (as rotary embedding does)."""
    from kernel_checks import make_paged

    from rooflm.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    H, Hkv, D, bs = 32, num_kv_heads, 128, 16
    lens0 = [700, 1, 0, 33]
    cache, tables = make_paged([2100] * 4, Hkv, D, bs, torch.float16, DEV)
    q = torch.randn(4, H, D, device=DEV, dtype=torch.float16)
    seq_lens = torch.tensor(lens0, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    scale = D ** -0.5
    q_src, cache_src = torch.empty_like(q), torch.empty_like(cache)

    def step():  # the kernel just before attention writes its inputs (a PDL launch must wait for them)
        q.copy_(q_src)
        cache.copy_(cache_src)
        paged_decode_attention(q, cache, tables, seq_lens, scale, out=out, fused_reduce=fused_reduce, pdl=pdl)

    step()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([2100, 5, 17, 0], [1, 1, 1, 1], [999, 2000, 16, 256]):
        q_src.copy_(torch.randn_like(q))
        cache_src.copy_(torch.randn_like(cache))
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_decode_attention_ref(q_src, cache_src, tables, seq_lens, scale)
        assert_close(out, ref, torch.float16, f"graph replay lens={lens}")


@pytest.mark.parametrize("num_kv_heads", [32, 20, 8])  # Llama-2-7B, one rank of Llama-2-13B at TP=2, GQA 4
@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_new_token_equals_rotary_then_attention(num_kv_heads, window, num_splits):
    # bit for bit on the compiled kernels too (the same float32 expressions, fused multiply-adds and all)
    from kernel_checks import check_decode_new_token

    heads = 20 if num_kv_heads == 20 else 32
    check_decode_new_token(heads, num_kv_heads, 128, 16, LENS + [0], seed=num_kv_heads, device=DEV, window=window,
                           num_splits=num_splits)
    check_decode_new_token(heads, num_kv_heads, 128, 16, [1024] * 4, seed=1, dtype=torch.bfloat16, device=DEV,
                           window=window, num_splits=num_splits)
