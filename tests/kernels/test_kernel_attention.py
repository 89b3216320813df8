"""Paged decode / prefill attention kernels and the Triton backend against the torch reference (small shapes)."""
import pytest
import torch

from kernel_checks import check_backend, check_decode, check_prefill


# GQA ratios 1, 4 and 8; odd lengths; lengths on and around block boundaries; padded rows (seq_len 0).
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("lens,block_size", [([1, 15, 16, 17], 16), ([33, 7, 0], 8)])
def test_decode_gqa_and_lengths(device, num_heads, num_kv_heads, lens, block_size):
    check_decode(num_heads, num_kv_heads, 64, block_size, lens, device=device, seed=len(lens) + num_heads)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("fused_reduce", [True, False])
def test_decode_split_counts(device, num_splits, fused_reduce):
    # more splits than tiles leaves empty splits; their partials must not disturb the sum. fused_reduce: the last
    # split program combines (one launch); otherwise a second kernel does.
    check_decode(4, 2, 32, 16, [100, 3, 48], num_splits=num_splits, device=device, seed=num_splits,
                 fused_reduce=fused_reduce)


@pytest.mark.parametrize("window", [1, 7, 16, 64])
def test_decode_sliding_window(device, window):
    check_decode(4, 1, 32, 8, [5, 40, 57], window=window, num_splits=3, device=device, seed=window)


def test_decode_head_dim_not_power_of_two(device):
    check_decode(6, 2, 80, 16, [19, 50], device=device)


def test_decode_bfloat16(device):
    check_decode(8, 2, 64, 16, [31, 65], dtype=torch.bfloat16, device=device)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("ctx_lens,q_lens", [([0, 0], [17, 1]), ([16, 5, 0], [16, 11, 3]), ([31], [2])])
def test_prefill_gqa_and_prefix(device, num_heads, num_kv_heads, ctx_lens, q_lens):
    check_prefill(num_heads, num_kv_heads, 32, 16, ctx_lens, q_lens, device=device, seed=sum(q_lens))


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_prefill_sliding_window(device, window):
    check_prefill(4, 2, 32, 8, [0, 21], [37, 12], window=window, device=device, seed=window)


def test_prefill_head_dim_not_power_of_two(device):
    check_prefill(4, 2, 48, 16, [3], [29], device=device)


def test_prefill_bfloat16(device):
    check_prefill(4, 1, 64, 16, [9, 0], [20, 13], dtype=torch.bfloat16, device=device)


@pytest.mark.parametrize("ctx_lens,q_lens", [([5, 16, 31], [1, 1, 1]), ([0, 40], [19, 1]), ([12], [20])])
@pytest.mark.parametrize("window", [None, 9])
def test_backend_matches_reference(device, ctx_lens, q_lens, window):
    check_backend(8, 2, 32, 16, ctx_lens, q_lens, window=window, device=device, seed=sum(ctx_lens))


def test_backend_via_get_attention_backend():
    from rooflm.attention.backend import get_attention_backend

    assert get_attention_backend("triton").name == "triton"


def _decode_vs_ref(device, num_heads, num_kv_heads, head_dim, block_size, lens, seed, window=None, dtype=torch.float16,
                   table_width=None, **kw):
    """Run paged_decode_attention with the given options on fresh random inputs (output poisoned with NaN) and
    compare with the torch twin."""
    from kernel_checks import assert_close, make_paged

    from rooflm.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    g = torch.Generator().manual_seed(seed)
    cache, tables = make_paged(lens, num_kv_heads, head_dim, block_size, dtype, device, gen=g)
    if table_width is not None:  # a table with no spare column: the kernel must not read past its end
        tables = tables[:, :table_width].contiguous()
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache, tables, seq_lens, scale, window, out=out, **kw)
    ref = paged_decode_attention_ref(q, cache, tables, seq_lens, scale, window)
    assert_close(out, ref, dtype, f"decode {kw} H={num_heads}/{num_kv_heads} lens={lens} w={window}")


# MHA has three inner loops: the dot-free one with one softmax state (default), the dot-free one with a state per
# tile row (lanes=True), and tl.dot with the query padded to 16 rows (use_dot=True).
@pytest.mark.parametrize("use_dot,lanes", [(None, False), (None, True), (True, False)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (2, 32)])
def test_decode_mha_inner_loops(device, use_dot, lanes, window, num_splits, block_n):
    _decode_vs_ref(device, 4, 4, 32, 8, [1, 15, 16, 17, 70, 0], seed=num_splits + block_n, window=window,
                   use_dot=use_dot, lanes=lanes, num_splits=num_splits, block_n=block_n)


@pytest.mark.parametrize("lanes", [False, True])
def test_decode_mha_fused_reduce_and_bfloat16(device, lanes):
    _decode_vs_ref(device, 2, 2, 64, 16, [33, 100, 0], seed=3, dtype=torch.bfloat16, lanes=lanes, num_splits=4,
                   block_n=16, fused_reduce=True)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2)])
def test_decode_table_without_spare_columns(device, num_heads, num_kv_heads):
    # the longest sequence uses every column; the first tile's table entries are loaded before the length is known
    _decode_vs_ref(device, num_heads, num_kv_heads, 32, 8, [40, 3, 17], seed=5, table_width=5, num_splits=3,
                   block_n=16)


def test_decode_rejects_bad_arguments(device):
    from rooflm.kernels.decode_attention import paged_decode_attention

    q = torch.randn(1, 4, 32, device=device)
    cache = torch.randn(2, 2, 8, 2, 32, device=device)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="use_dot"):
        paged_decode_attention(q, cache, tables, lens, 1.0, use_dot=False)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, cache, tables, lens, 1.0, num_splits=0)


@pytest.mark.parametrize("num_sms", [8, 132])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_default_plan_fills_the_device(num_sms, group):
    # the plan depends on the batch shape only; it splits until the grid has about 4-8 programs per multiprocessor,
    # never splits a batch that already has 2 programs per multiprocessor, and keeps tl.dot for GQA
    from rooflm.kernels.decode_attention import default_plan

    for num_seqs in (1, 2, 3, 8, 32, 256):
        for num_kv_heads in (1, 8, 32):
            plan = default_plan(num_seqs, num_kv_heads, group, num_sms)
            programs = num_seqs * num_kv_heads
            assert 1 <= plan.num_splits <= 32
            if programs >= 2 * num_sms:
                assert plan.num_splits == 1 and plan.use_dot
            else:
                assert programs * plan.num_splits >= min(4 * num_sms, 32 * programs)
            if group > 1:
                assert plan.use_dot
            assert plan.fused_reduce == (not plan.use_dot)  # the last split program combines: dot-free MHA only


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_decode_default_plan_combines_in_the_split_kernel_for_mha_only(device, monkeypatch, num_heads, num_kv_heads):
    # the dot-free MHA plan combines the partials in its last split program (no reduce launch); the output equals
    # the two-kernel path bit for bit (the same combine code), GQA keeps the reduce kernel, and
    # ROOFLM_DECODE_FUSED_REDUCE=0 restores it for MHA
    from kernel_checks import make_paged

    import rooflm.kernels.decode_attention as da

    launches = []
    reduce_kernel = da._decode_reduce_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return reduce_kernel[grid]

    monkeypatch.setattr(da, "_decode_reduce_kernel", Counting())
    g = torch.Generator().manual_seed(11)
    lens = [70, 1, 0, 33]
    cache, tables = make_paged(lens, num_kv_heads, 32, 8, torch.float16, device, gen=g)
    q = torch.randn(len(lens), num_heads, 32, generator=g).to(torch.float16).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    mha = num_heads == num_kv_heads
    plan = da.default_plan(len(lens), num_kv_heads, num_heads // num_kv_heads, 132)
    assert plan.fused_reduce == mha == (not plan.use_dot) and plan.num_splits > 1

    def run(**kw):
        out = torch.full_like(q, float("nan"))
        da.paged_decode_attention(q, cache, tables, seq_lens, 0.2, out=out, **kw)
        return out

    monkeypatch.setattr(da, "device_sms", lambda _t: 132)
    default = run()
    assert len(launches) == (0 if mha else 1)
    two_kernels = run(fused_reduce=False)
    assert len(launches) == (1 if mha else 2)
    assert torch.equal(default, two_kernels)
    monkeypatch.setenv("ROOFLM_DECODE_FUSED_REDUCE", "0")
    assert torch.equal(run(), two_kernels)
    assert len(launches) == (2 if mha else 3)


def test_fused_reduce_tickets_outgrown_stay_allocated(monkeypatch):
    # a CUDA graph captured with the ticket buffer keeps its address: growing the buffer must not free the old one
    import rooflm.kernels.decode_attention as da

    monkeypatch.setattr(da, "_counters", {})
    monkeypatch.setattr(da, "_retired_counters", [])
    dev = torch.device("cpu")
    small = da._counter_buffer(dev, 10)
    assert small.numel() >= 10 and not small.any()
    assert da._counter_buffer(dev, 20) is small
    big = da._counter_buffer(dev, small.numel() + 1)
    assert big is not small and big.numel() > small.numel()
    assert any(t is small for t in da._retired_counters)
