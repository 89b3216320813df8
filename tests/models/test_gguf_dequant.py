"""GGUF dequantization of every listed type, checked three ways on small tensors written with ``gguf.GGUFWriter``:
against an independent numpy decoding of the block layout (ggml's formulas), against the gguf package's own
dequantizer, and (for the types gguf can quantize) against the original float values."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter
from gguf.quants import dequantize, quantize

from rooflm.loader.gguf import dequantize_tensor, open_gguf

ROWS, COLS = 3, 512  # two 256-value super-blocks per row


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def ref_q8_0(raw: np.ndarray) -> np.ndarray:  # block: f16 d, 32 x int8
    b = raw.reshape(-1, 34)
    return (_f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


def ref_q4_0(raw: np.ndarray) -> np.ndarray:  # block: f16 d, 16 bytes of nibbles (low nibbles first), q - 8
    b = raw.reshape(-1, 18)
    qs = b[:, 2:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32) - 8
    return (_f16(b[:, :2]) * q).reshape(-1)


def ref_q4_1(raw: np.ndarray) -> np.ndarray:  # block: f16 d, f16 m, 16 bytes of nibbles; d * q + m
    b = raw.reshape(-1, 20)
    qs = b[:, 4:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
    return (_f16(b[:, :2]) * q + _f16(b[:, 2:4])).reshape(-1)


def ref_q4_k(raw: np.ndarray) -> np.ndarray:
    """Super-block of 256: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks, 128 bytes nibbles."""
    out = []
    for blk in raw.reshape(-1, 144):
        d, dmin = _f16(blk[0:2])[0], _f16(blk[2:4])[0]
        s = blk[4:16].astype(np.int32)
        sc = [s[j] & 63 if j < 4 else (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4) for j in range(8)]
        mn = [s[j + 4] & 63 if j < 4 else (s[j + 4] >> 4) | ((s[j] >> 6) << 4) for j in range(8)]
        qs = blk[16:].reshape(4, 32)  # 64 values per row: low nibbles then high nibbles
        for j in range(4):
            out.append(d * sc[2 * j] * (qs[j] & 0xF) - dmin * mn[2 * j])
            out.append(d * sc[2 * j + 1] * (qs[j] >> 4) - dmin * mn[2 * j + 1])
    return np.concatenate(out).astype(np.float32)


def ref_q6_k(raw: np.ndarray) -> np.ndarray:
    """Super-block of 256: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d; q - 32."""
    out = []
    for blk in raw.reshape(-1, 210):
        ql, qh = blk[:128].astype(np.int32), blk[128:192].astype(np.int32)
        scales = blk[192:208].view(np.int8).astype(np.float32)
        d = _f16(blk[208:210])[0]
        y = np.zeros(256, np.float32)
        for n in range(2):
            l_, h_, sc = ql[64 * n:], qh[32 * n:], scales[8 * n:]
            for l in range(32):
                i = l // 16
                q1 = ((l_[l] & 0xF) | (((h_[l] >> 0) & 3) << 4)) - 32
                q2 = ((l_[l + 32] & 0xF) | (((h_[l] >> 2) & 3) << 4)) - 32
                q3 = ((l_[l] >> 4) | (((h_[l] >> 4) & 3) << 4)) - 32
                q4 = ((l_[l + 32] >> 4) | (((h_[l] >> 6) & 3) << 4)) - 32
                base = 128 * n + l
                y[base], y[base + 32] = d * sc[i] * q1, d * sc[i + 2] * q2
                y[base + 64], y[base + 96] = d * sc[i + 4] * q3, d * sc[i + 6] * q4
        out.append(y)
    return np.concatenate(out)


def random_k_blocks(qtype: Q, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes with finite, modest f16 scales (gguf cannot quantize K types itself)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_rows, n_cols // block, size), dtype=np.uint8)
    scale_offsets = (0, 2) if qtype == Q.Q4_K else (208,)
    for off in scale_offsets:
        raw[:, :, off:off + 2] = rng.uniform(0.001, 0.05, size=raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n_rows, -1)


REFS = {Q.Q8_0: ref_q8_0, Q.Q4_0: ref_q4_0, Q.Q4_1: ref_q4_1, Q.Q4_K: ref_q4_k, Q.Q6_K: ref_q6_k}
QUANTIZABLE_TOL = {Q.F32: 0.0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.05, Q.Q4_0: 0.6, Q.Q4_1: 0.5}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A GGUF with one [ROWS, COLS] tensor per type; returns (path, {type: (original float or None, raw data)})."""
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("gguf") / "types.gguf")
    writer = GGUFWriter(path, "llama")
    tensors = {}
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    for qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K):
        if qtype in QUANTIZABLE_TOL:
            raw = x if qtype == Q.F32 else quantize(x, qtype)
            tensors[qtype] = (x, raw)
        else:
            raw = random_k_blocks(qtype, ROWS, COLS, rng)
            tensors[qtype] = (None, raw)
        writer.add_tensor(f"t.{qtype.name}", raw, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, tensors


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_dequantize(gguf_file, qtype: Q) -> None:
    path, tensors = gguf_file
    original, raw = tensors[qtype]
    reader = open_gguf(path)
    t = next(t for t in reader.tensors if t.name == f"t.{qtype.name}")
    assert t.tensor_type == qtype
    ours = dequantize_tensor(t)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == (ROWS, COLS)
    # The gguf package's own decoding of the bytes we wrote.
    np.testing.assert_array_equal(ours.numpy(), dequantize(raw, qtype).reshape(ROWS, COLS))
    if qtype in REFS:  # an independent decoding of the block layout
        np.testing.assert_allclose(ours.numpy().reshape(-1), REFS[qtype](raw.reshape(-1)), rtol=1e-6, atol=1e-6)
    if original is not None:
        assert np.abs(ours.numpy() - original).max() <= QUANTIZABLE_TOL[qtype]
