"""The native CPU float32 operators (``rooflm.kernels.cpu_native.ops``): RMSNorm, rotary embedding + cache write,
decode-style attention and argmax. Checked against torch's maths, for the properties the CPU path relies on (each
token's attention computed on its own, the paged cache read in place with the floats of a gathered copy, results
that do not depend on the thread count), against the portable C build, and for the errors bad arguments get."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rooflm.kernels.cpu_native import load_library, ops
from rooflm.kernels.cpu_native import build as native_build


@pytest.fixture(autouse=True)
def _native(monkeypatch):
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "on")  # a missing compiler fails here rather than skipping the checks


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One token q [Hq, D] over k, v [L, Hkv, D], in float64 (query head h on KV head h // group)."""
    hq, d = q.shape
    hkv = k.shape[1]
    kk = k.double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, L, D]
    vv = v.double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    p = torch.softmax((kk @ q.double()[:, :, None]).squeeze(-1) * scale, dim=-1)
    return (p[:, None, :] @ vv).squeeze(1).float()


def _qkv(t: int, length: int, hq: int = 9, hkv: int = 3, d: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, hq, d, generator=gen), torch.randn(length, hkv, d, generator=gen),
            torch.randn(length, hkv, d, generator=gen))


@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 576), (3, 100), (2, 7)])
def test_rms_norm_matches_torch_and_rows_are_independent(rows, dim):
    gen = torch.Generator().manual_seed(dim)
    x, w = torch.randn(rows, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    out = ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, F.rms_norm(x, (dim,), w, 1e-6), rtol=2e-6, atol=2e-6)
    for i in range(rows):
        assert torch.equal(ops.rms_norm(x[i:i + 1], w, 1e-6), out[i:i + 1])


def _argmax_rows(seed: int) -> list[torch.Tensor]:
    """Rows that try argmax's rules: ties (small integers), NaNs (the first one counts), infinities, all -inf,
    lengths around the 16 lanes, a vocabulary-wide row and rows that are not packed (a strided view)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate([1, 15, 16, 17, 33, 100, 49152]):
        x = torch.randint(-3, 4, (3, n), generator=gen).float() if i % 2 else torch.randn(3, n, generator=gen)
        out.append(x)
        y = x.clone()
        y[torch.rand(3, n, generator=gen) < 0.05] = float("nan")
        y[0, -1] = float("nan")  # a NaN only in the tail of one row
        out.append(y)
        z = x.clone()
        z[torch.rand(3, n, generator=gen) < 0.1] = float("inf")
        out.append(z)
        out.append(torch.full((2, n), float("-inf")))
        out.append(torch.randn(3, n + 7, generator=gen)[:, :n])
    return out


def test_argmax_gives_torchs_indices():
    for x in _argmax_rows(0):
        got = ops.argmax(x)
        assert got is not None and got.dtype == torch.int64
        assert torch.equal(got, x.max(dim=-1).indices), (x.shape, got)
    assert ops.argmax(torch.randn(2, 8, dtype=torch.float64)) is None
    assert ops.argmax(torch.randn(4, 8).t()) is None  # columns not packed: torch's operator


def test_greedy_choice_goes_through_the_native_argmax(monkeypatch):
    from rooflm.layers.sampler import argmax_tokens

    x = torch.randn(2, 1000)
    calls = []
    original = ops.argmax
    monkeypatch.setattr(ops, "argmax", lambda t: calls.append(t.shape) or original(t))
    assert torch.equal(argmax_tokens(x), x.argmax(dim=-1))
    assert calls == [(2, 1000)]


@pytest.mark.parametrize("hq,hkv,d,length", [(9, 3, 64, 250), (4, 4, 32, 17), (8, 2, 128, 40), (6, 3, 24, 33)])
def test_attention_matches_softmax_attention(hq, hkv, d, length):
    """Head dims that are multiples of 16 take the vector path, others (24) the portable one."""
    q, k, v = _qkv(3, length, hq, hkv, d, seed=length)
    counts = [length - 2, length - 1, length]
    out = ops.attend(q, k, v, d ** -0.5, counts)
    for t, n in enumerate(counts):
        torch.testing.assert_close(out[t], _sdpa(q[t], k[:n], v[:n], d ** -0.5), rtol=1e-5, atol=1e-5)


def test_each_token_is_computed_on_its_own():
    """A verify step's token gets the floats of the decode step at its position, bit for bit."""
    q, k, v = _qkv(5, 120)
    counts = [116, 117, 118, 119, 120]
    out = ops.attend(q, k, v, 0.125, counts)
    for t, n in enumerate(counts):
        assert torch.equal(ops.attend(q[t:t + 1], k[:n], v[:n], 0.125, [n]), out[t:t + 1])


def test_explicit_positions_read_just_those_keys():
    """A token tree's token reads the context and its ancestors: the keys at its listed positions."""
    q, k, v = _qkv(2, 50)
    rows = [torch.tensor([0, 3, 9, 49]), torch.arange(0, 50, 2)]
    out = ops.attend(q, k, v, 0.125, [len(r) for r in rows], torch.cat(rows))
    for t, r in enumerate(rows):
        assert torch.equal(out[t:t + 1], ops.attend(q[t:t + 1], k[r], v[r], 0.125, [len(r)]))


@pytest.mark.parametrize("tree", [False, True])
def test_paged_cache_is_read_in_place_with_the_gathered_floats(tree):
    """With a block table the context is read from the cache's scattered blocks: the same bits as attention over
    the gathered context."""
    bs, hkv, d, length = 16, 3, 64, 70
    blocks = torch.tensor([6, 2, 9, 0, 4])
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 10, bs, hkv, d, generator=gen)
    q = torch.randn(2, 9, d, generator=gen)
    gathered = cache[:, blocks].flatten(1, 2)[:, :length]  # [2, L, Hkv, D]
    planes = cache.view(2, -1, hkv, d)
    if tree:
        rows = [torch.tensor([0, 17, 33, 68]), torch.tensor([1, 2, 69])]
        counts, positions = [4, 3], torch.cat(rows)
    else:
        counts, positions = [length - 1, length], None
    paged = ops.attend(q, planes[0], planes[1], 0.125, counts, positions, blocks=blocks, block_size=bs)
    assert torch.equal(paged, ops.attend(q, gathered[0], gathered[1], 0.125, counts, positions))


def test_thread_count_does_not_change_the_result():
    q, k, v = _qkv(4, 300)
    counts = [297, 298, 299, 300]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.attend(q, k, v, 0.125, counts)
        torch.set_num_threads(2)
        two = ops.attend(q, k, v, 0.125, counts)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_rope_write_rotates_and_writes_valid_slots():
    t, hq, hkv, d, bs = 3, 4, 2, 16, 4
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    heads = qkv.view(t, hq + 2 * hkv, d)
    qk, v = heads[:, : hq + hkv], heads[:, hq + hkv:]
    ang = torch.randn(t, 1, d // 2, generator=gen)
    cos2, sin2 = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((-ang.sin(), ang.sin()), -1)
    cache = torch.zeros(2, 3, bs, hkv, d)
    slots = torch.tensor([5, -1, 10])
    out = ops.rope_write(qk, v, cos2, sin2, cache, slots)
    expected = qk * cos2 + qk.roll(d // 2, dims=-1) * sin2
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    flat = cache.view(2, -1, hkv, d)
    assert torch.equal(flat[0, 5], out[0, hq:]) and torch.equal(flat[1, 5], v[0])
    assert torch.equal(flat[0, 10], out[2, hq:]) and torch.equal(flat[1, 10], v[2])
    written = torch.zeros(flat.shape[1], dtype=torch.bool)
    written[[5, 10]] = True
    assert not flat[:, ~written].any()  # the negative slot wrote nothing


def test_inputs_it_does_not_take_fall_back_to_torch():
    q, k, v = _qkv(1, 20)
    assert ops.attend(q.double(), k.double(), v.double(), 0.125, [20]) is None
    assert ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), 1e-6) is None


def test_bad_arguments_are_refused():
    q, k, v = _qkv(2, 20)
    with pytest.raises(ValueError, match="nkeys"):
        ops.attend(q, k, v, 0.125, [20, 21])
    with pytest.raises(ValueError, match="nkeys"):
        ops.attend(q, k, v, 0.125, [20])
    with pytest.raises(ValueError, match="positions"):
        ops.attend(q[:1], k, v, 0.125, [2], torch.tensor([0, 20]))
    with pytest.raises(ValueError, match="blocks"):
        ops.attend(q[:1], k, v, 0.125, [4], blocks=torch.tensor([0, 5]), block_size=4)


def test_portable_build_agrees(monkeypatch, tmp_path):
    """The portable C build: RMSNorm the same bits (the same order of operations), attention to float rounding (its
    sums run in another order)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    default = ops.native_ops()
    scalar = load_library(("-DQMM_FORCE_SCALAR",))
    assert native_build.isa_name(scalar) == "scalar"
    q, k, v = _qkv(2, 90)
    x, w = torch.randn(3, 576), torch.randn(576)
    a = (ops.rms_norm(x, w, 1e-5), ops.attend(q, k, v, 0.125, [89, 90]))
    monkeypatch.setattr(ops, "native_ops", lambda: scalar)
    b = (ops.rms_norm(x, w, 1e-5), ops.attend(q, k, v, 0.125, [89, 90]))
    assert default is not scalar
    for r in _argmax_rows(1):
        assert torch.equal(ops.argmax(r), r.max(dim=-1).indices)
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)


def test_decode_of_several_sequences_gives_each_its_own_decode_floats():
    """A decode step of several sequences passes one block table row per token: each sequence's result is the bits
    of its decode step alone; a row's padding past its sequence (here -1) is not read."""
    bs, hkv, d = 16, 3, 64
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 12, bs, hkv, d, generator=gen)
    planes = cache.view(2, -1, hkv, d)
    q = torch.randn(3, 9, d, generator=gen)
    tables = torch.tensor([[3, 7, 1, -1], [0, 11, 5, 9], [8, -1, -1, -1]])
    lens = [40, 61, 5]
    out = ops.attend(q, planes[0], planes[1], 0.125, lens, blocks=tables, block_size=bs)
    for i, n in enumerate(lens):
        row = tables[i, : -(-n // bs)]
        alone = ops.attend(q[i:i + 1], planes[0], planes[1], 0.125, [n], blocks=row, block_size=bs)
        assert torch.equal(out[i:i + 1], alone)
        gathered = cache[:, row].flatten(1, 2)[:, :n]
        torch.testing.assert_close(alone[0], _sdpa(q[i], gathered[0], gathered[1], 0.125), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="blocks"):
        ops.attend(q, planes[0], planes[1], 0.125, [40, 61, 17], blocks=tables, block_size=bs)  # reads a -1
    with pytest.raises(ValueError, match="blocks"):
        ops.attend(q, planes[0], planes[1], 0.125, lens, blocks=tables[:2], block_size=bs)


def test_a_table_is_checked_unless_the_caller_did():
    """A caller that checked its table once a step (the CPU backend, for all its layers) skips the per-call check;
    otherwise an index outside the cache is refused."""
    bs, hkv, d = 4, 3, 64
    q, k, v = _qkv(1, 5 * bs, 9, hkv, d)
    table = torch.tensor([4, 0, 2])
    out = ops.attend(q, k, v, 0.125, [10], blocks=table, block_size=bs)
    assert torch.equal(ops.attend(q, k, v, 0.125, [10], blocks=table, block_size=bs, blocks_checked=True), out)
    with pytest.raises(ValueError, match="blocks"):
        ops.attend(q, k, v, 0.125, [10], blocks=torch.tensor([4, 5, 2]), block_size=bs)
