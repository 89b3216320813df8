"""Attention on the CPU in as few torch ops as the maths allows: the default backend for models on a CPU.

The reference backend (``torch_ref``) is written to be obviously correct: it repeats K/V per query head, builds an
explicit mask and runs ~15 small ops per sequence and layer. At batch 1 on a laptop, where a 135M-parameter model's
whole decode step takes a few milliseconds, those ops cost as much as the weights' memory traffic. This backend does
the same maths with:

- rotary embedding (Su et al. 2021, Hugging Face's rotate-half layout) as ``x * cos2 + roll(x, d/2) * sin2`` on q and
  k, with ``cos2 = [cos, cos]`` and ``sin2 = [-sin, sin]`` built once per step (every layer shares the positions);
  the products and the sum are the ones the reference computes, so the result is the same up to the fused
  multiply-add of ``addcmul``;
- decode (one query token per sequence), float32: one call of the native operator
  (``rooflm.kernels.cpu_native.ops``, C compiled on first use), a few microseconds where torch's flash kernel costs
  tens for one query, reading each sequence's context in place through its block table (one table row per token
  when several sequences decode together, so each gets the floats of its decode step alone); without it
  (``ROOFLM_CPU_NATIVE=off``, no compiler, other dtypes), the query heads that share a KV head are laid out as that
  head's query rows, so ``scaled_dot_product_attention`` runs as plain multi-head attention over the gathered
  context without a mask and without copying K/V per query head (grouped-query attention, Ainslie et al. 2023);
- prefill and chunked prefill: one ``scaled_dot_product_attention`` per sequence, causal through ``is_causal`` when
  the chunk is the whole context and through an explicit mask otherwise (or with a sliding window). A chunk of more
  than ``EXACT_MAX_QUERY`` tokens passes 4-D tensors (a batch of one): torch runs its fused CPU kernel (flash
  attention, Dao et al. 2022) only on 4-D inputs, and 3-D ones fall back to the unfused maths, which materialises
  every score and copies K/V per query head: 3-7x slower for a 300-1000-token prompt of SmolLM2-135M's shape. A step
  of at most ``EXACT_MAX_QUERY`` tokens after a cached prefix (a speculative verify step, a chain or a token tree)
  attends token by token through the decode step's own call (``attend_as_decode``), so that each drafted token is
  scored with the decode step's floats; a short step with a sliding window keeps one 3-D call.

Checked against the reference in ``tests/kernels/test_cpu_attention.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rooflm.attention.backend import AttentionMetadata, rotary_write_then_attend, write_kv_cache
from rooflm.attention.kv_quant import QuantizedKVCache, gather_blocks
from rooflm.kernels.cpu_native.ops import attend as native_attend
from rooflm.kernels.cpu_native.ops import native_ops
from rooflm.kernels.cpu_native.ops import rope_write as native_rope_write


def _gather(kv_cache, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys and values of ``blocks`` in one tensor [2, *blocks.shape, block_size, num_kv_heads, head_dim] of
    ``dtype`` (a quantized cache is dequantized as it is gathered)."""
    if isinstance(kv_cache, QuantizedKVCache):
        return torch.stack((gather_blocks(kv_cache, 0, blocks), gather_blocks(kv_cache, 1, blocks))).to(dtype)
    return kv_cache[:, blocks]


class CpuAttention:
    """The CPU backend (see ``AttentionBackend``). Runs on any device, but is tuned for, and chosen on, the CPU.

    A model shares one instance among its layers (``Attention.choose``), so what depends only on the step (the
    rotary tables, the block indices of a single decoding sequence, whether every slot is valid) is computed by the
    first layer and reused by the others: about a dozen small ops per layer that a CPU pays in dispatch time."""

    name = "cpu"
    programmatic_launch = False
    rotary_write_attend = rotary_write_then_attend

    def __init__(self) -> None:
        self._rope_for: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._meta: AttentionMetadata | None = None
        self._slots_valid = True
        self._slots_end = 0  # one past the largest slot of the step
        self._decode_blocks: torch.Tensor | None = None
        self._decode_blocks_range = (0, -1)  # (min, max) of _decode_blocks

    def _rope_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] tables ``[cos, cos]`` and ``[-sin, sin]``, made once per step: every layer of a forward
        gets the same cos/sin tensor objects. The tensors themselves are kept (not their ids, which Python reuses
        once an object is freed), so a new step's tables are never mistaken for the last step's."""
        last = self._rope_for
        if last is None or last[0] is not cos or last[1] is not sin:
            self._rope = (torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1))
            self._rope_for = (cos, sin)
        return self._rope

    def _step(self, meta: AttentionMetadata, block_size: int) -> None:
        """Per-step facts of ``meta``, computed once (the metadata object itself is kept, as for the rotary tables)."""
        if self._meta is meta:
            return
        self._meta = meta
        self._slots_valid = bool((meta.slot_mapping >= 0).all())
        self._slots_end = int(meta.slot_mapping.max()) + 1 if meta.slot_mapping.numel() else 0
        self._decode_blocks = None
        if meta.is_decode_only and meta.num_seqs == 1:
            seq_len = meta.seq_lens_cpu[0]
            self._decode_blocks = meta.block_tables[0, : (seq_len + block_size - 1) // block_size].long()
            # checked against each layer's cache by _decode with two integers instead of two ops a layer
            self._decode_blocks_range = (int(self._decode_blocks.min()), int(self._decode_blocks.max()))

    def rotary_and_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        self._step(meta, kv_cache.shape[2])
        cos2, sin2 = self._rope_tables(cos, sin)
        half = q.shape[-1] // 2
        qk = _adjacent_heads(q, k)
        if qk is not None:
            rotated = self.native_rope_write(qk, v, cos2, sin2, kv_cache, meta)
            if rotated is not None:
                return rotated[:, : q.shape[1]], rotated[:, q.shape[1]:]
        if qk is not None:  # q and k are neighbouring column ranges of one qkv row: rotate both in one pass
            qk = torch.addcmul(qk * cos2, qk.roll(half, dims=-1), sin2)
            q, k = qk[:, : q.shape[1]], qk[:, q.shape[1]:]
        else:
            q = torch.addcmul(q * cos2, q.roll(half, dims=-1), sin2)
            k = torch.addcmul(k * cos2, k.roll(half, dims=-1), sin2)
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, all_valid=self._slots_valid)
        return q, k

    @property
    def uses_native(self) -> bool:
        """Whether the native CPU operators are on (``ROOFLM_CPU_NATIVE``, a compiler): float32 steps then rotate,
        write and attend through them."""
        return native_ops() is not None

    def native_rope_write(self, qk: torch.Tensor, v: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor,
                          kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The rotated qk heads [T, Hq + Hkv, D], K and V written, by the native operator (one call where torch
        takes about six ops); None where it does not apply (the caller then runs torch's ops): not float32, a
        quantized cache, no native library. The module path and the lean loop both come here, so they agree."""
        if type(kv_cache) is not torch.Tensor or self._slots_end > kv_cache.shape[1] * kv_cache.shape[2]:
            return None  # a slot out of range: torch's scatter raises the error
        return native_rope_write(qk, v, cos2, sin2, kv_cache, meta.slot_mapping)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None = None, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None) -> torch.Tensor:
        """``k`` and ``v`` are accepted for the backend protocol and not used: the cache is read in place."""
        self._step(meta, kv_cache.shape[2])
        if meta.is_decode_only and sliding_window is None:
            return _decode(q, kv_cache, meta, scale, self._decode_blocks, self._decode_blocks_range)
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        block_size = kv_cache.shape[2]
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            s, e = starts[i], starts[i + 1]
            if e == s:
                continue
            blocks = meta.block_tables[i, : (seq_len + block_size - 1) // block_size].long()
            kv = _gather(kv_cache, blocks, q.dtype).flatten(1, 2)[:, :seq_len]  # [2, L, Hkv, D]
            tree = meta.tree_masks[i] if meta.tree_masks is not None else None
            out[s:e] = _prefill_one(q[s:e], kv[0], kv[1], scale, sliding_window, tree)
        return out


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """A [T, Hq + Hkv, D] view over q [T, Hq, D] and k [T, Hkv, D] when k's heads directly follow q's in memory (the
    model splits one qkv projection row into views), else None. Lets the rotary embedding run as one set of ops."""
    t, hq, d = q.shape
    if (k.dtype != q.dtype or k.shape[0] != t or k.shape[2] != d or q.stride()[1:] != (d, 1)
            or k.stride()[1:] != (d, 1) or (t > 1 and k.stride(0) != q.stride(0))
            or k.data_ptr() != q.data_ptr() + hq * d * q.element_size()):
        return None
    return q.as_strided((t, hq + k.shape[1], d), q.stride())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One token's attention over its whole context: q [1, Hq, D], k and v [L, Hkv, D] (position-major) ->
    [1, Hq, D]. The native operator in float32 (``rooflm.kernels.cpu_native.ops``: one call, a few microseconds
    where torch's flash kernel costs tens), else torch's ``scaled_dot_product_attention`` with query head h on KV
    head h // group. ``attend_as_decode`` makes the same choice, so a verify step's token matches its decode step."""
    out = native_attend(q, k, v, scale, [k.shape[0]])
    if out is not None:
        return out
    _, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(1, hkv, hq // hkv, d)  # query head h uses KV head h // group
    return F.scaled_dot_product_attention(qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          scale=scale).view(1, hq, d)


def native_paged_attend(q: torch.Tensor, kv_cache: torch.Tensor, scale: float, nkeys: list[int],
                        positions: torch.Tensor | None, blocks: torch.Tensor,
                        blocks_checked: bool = False) -> torch.Tensor | None:
    """The native operator over a paged cache read in place (the floats of a gathered copy, without the copy; see
    ``rooflm.kernels.cpu_native.ops.attend`` for ``nkeys``, ``positions`` and ``blocks``); None where it does not
    apply: a cache that is not a plain contiguous tensor of q's dtype, or no native library."""
    if type(kv_cache) is not torch.Tensor or kv_cache.dtype != q.dtype or not kv_cache.is_contiguous():
        return None
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    planes = kv_cache.view(2, -1, num_kv_heads, head_dim)
    return native_attend(q, planes[0], planes[1], scale, nkeys, positions, blocks=blocks, block_size=block_size,
                         blocks_checked=blocks_checked)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            blocks: torch.Tensor | None = None, blocks_range: tuple[int, int] | None = None) -> torch.Tensor:
    """One query per sequence, full attention. q [S, H, D] -> [S, H, D]. ``blocks``: the one sequence's block
    indices (int64), when the caller has them; ``blocks_range``: their (min, max), known once a step."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if num_seqs == 1:
        seq_len = meta.seq_lens_cpu[0]
        if blocks is None:
            blocks = meta.block_tables[0, : (seq_len + block_size - 1) // block_size].long()
        checked = blocks_range is not None and 0 <= blocks_range[0] and blocks_range[1] < kv_cache.shape[1]
        out = native_paged_attend(q, kv_cache, scale, [seq_len], None, blocks, checked)
        if out is not None:
            return out
        kv = _gather(kv_cache, blocks, q.dtype).flatten(1, 2)[:, :seq_len]  # [2, L, Hkv, D]
        return decode_attention(q, kv[0], kv[1], scale)
    max_blocks = (meta.max_seq_len + block_size - 1) // block_size
    tables = meta.block_tables[:, :max_blocks].long()
    # several sequences, each through its own block table in one native call: each one's floats are those of its
    # decode step alone
    out = native_paged_attend(q, kv_cache, scale, list(meta.seq_lens_cpu), None, tables)
    if out is not None:
        return out
    # several sequences: gather every table to the longest context and mask each sequence's tail
    length = max_blocks * block_size
    kv = _gather(kv_cache, tables, q.dtype).view(2, num_seqs, length, num_kv_heads, head_dim).transpose(2, 3)
    k, v = kv[0], kv[1]  # [S, Hkv, L, D]
    lens = torch.tensor(meta.seq_lens_cpu, device=q.device)
    mask = (torch.arange(length, device=q.device)[None, :] < lens[:, None])[:, None, None, :]  # [S, 1, 1, L]
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale).view(num_seqs, num_heads, head_dim)


# A step of at most this many new tokens per sequence attends token by token after a cached prefix (a verify step)
# or through one unfused call (a short prompt); longer ones through torch's fused kernel (module docstring).
EXACT_MAX_QUERY = 32


def heads_first(x: torch.Tensor, q_len: int) -> torch.Tensor:
    """[len, heads, D] -> [heads, len, D] for a step of ``q_len`` new tokens, or [1, heads, len, D] (torch's fused
    kernel) when the step is longer than ``EXACT_MAX_QUERY`` (see the module docstring)."""
    x = x.transpose(0, 1)
    return x[None] if q_len > EXACT_MAX_QUERY else x


def decode_key_rows(q_len: int, seq_len: int, tree: torch.Tensor | None) -> list[torch.Tensor] | None:
    """For each of a step's q_len new tokens, the positions of the keys its decode step would read: the cached
    context, then the new tokens it sees (itself included), in order; None for a causal step (its keys are a
    prefix, ``attend_as_decode`` slices it)."""
    if tree is None:
        return None
    ctx = torch.arange(seq_len - q_len)
    return [torch.cat((ctx, (seq_len - q_len) + row.nonzero().flatten())) for row in tree.to("cpu")]


def decode_key_counts(t: int, length: int, rows: list[torch.Tensor] | None
                      ) -> tuple[list[int], torch.Tensor | None]:
    """The native attention's form of ``decode_key_rows``: keys per token, and their positions one list after
    another (None for a causal step: token i reads the first length - t + i + 1 positions)."""
    if rows is None:
        return [length - t + i + 1 for i in range(t)], None
    return [len(r) for r in rows], torch.cat(rows)


def attend_as_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     rows: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of the last T positions of one sequence, each token through the decode step's own call.
    q [T, Hq, D]; k, v [L, Hkv, D] (the context, the new tokens last) -> [T, Hq, D]. ``rows`` (``decode_key_rows``):
    per token, the key positions it reads (a token tree's token reads the context and its ancestors); None: causal.

    A speculative verify step must score each drafted token as the decode step at its position would: greedy
    speculation keeps the plain path's tokens only then. One masked call over all T tokens (fused or not) rounds
    differently from the decode step's unmasked call over exactly the keys it reads, enough to flip near ties (on the
    default model: the first differing token 5-40 tokens into Medusa runs, in most prompts); T calls of the decode
    step's shapes and layout give its floats. For a few tokens over a short context this is also about as fast as one
    call (SmolLM2's shape, 250 keys, one thread: 5 x 17 us, against 183 us unfused and 57 us fused for 5 tokens)."""
    t, hq, d = q.shape
    length, hkv, _ = k.shape
    out = native_attend(q, k, v, scale, *decode_key_counts(t, length, rows))
    if out is not None:  # the native operator computes each token on its own, as ``decode_attention`` does
        return out
    out = torch.empty_like(q)
    for i in range(t):
        if rows is None:
            ki, vi = k[: length - t + i + 1], v[: length - t + i + 1]
        else:
            ki, vi = k.index_select(0, rows[i]), v.index_select(0, rows[i])
        qg = q[i].view(1, hkv, hq // hkv, d)  # as the decode step: query head h uses KV head h // group
        # [1, Hkv, n, D] with the decode step's strides (position-major, heads inside)
        out[i] = F.scaled_dot_product_attention(qg, ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
                                                scale=scale).view(hq, d)
    return out


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 sliding_window: int | None, tree: torch.Tensor | None = None) -> torch.Tensor:
    """The last q_len positions of one sequence attend causally to its seq_len context. q [Q, H, D], k/v [L, Hkv, D].
    ``tree`` [Q, Q] bool: instead of causally, the new tokens see each other where it is True (a token tree)."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    if sliding_window is None and q_len < seq_len and q_len <= EXACT_MAX_QUERY:
        return attend_as_decode(q, k, v, scale, decode_key_rows(q_len, seq_len, tree))
    qh, kh, vh = (heads_first(t, q_len) for t in (q, k, v))
    gqa = num_heads != num_kv_heads
    if tree is not None:
        allowed = torch.cat([torch.ones(q_len, seq_len - q_len, dtype=torch.bool, device=q.device),
                             tree.to(q.device)], dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    elif sliding_window is None and q_len == seq_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return (out[0] if out.dim() == 4 else out).transpose(0, 1)
