"""GGUF block formats repacked into the packed layout: every supported type decodes to exactly what the gguf
package's dequantizer gives (float32, bit for bit), the nibble order follows packed.py, casts to fp16/bf16 touch only
the scales and mins, and every tensor of the embedded SmolLM2 file repacks exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from rooflm.loader.gguf import iter_gguf_tensors, open_gguf, read_gguf_config
from rooflm.quantization.gguf_repack import (REPACKABLE_TYPES, UnsupportedGGUFType, gguf_to_packed,
                                             is_repackable)
from rooflm.quantization.packed import PackedWeight, codes, dequantize

N, K = 6, 768  # three 256-value super-blocks per row

# Byte offsets of the fp16 super-block scales (d, and dmin where present) of the K-quants.
K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_k_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid K-quant bytes (the gguf package cannot quantize K types): every code, sub-block scale and min
    byte random, the fp16 super-block scales finite, of both signs, with a few zeros and fp16 subnormals."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[qtype]:
        d = rng.uniform(-0.08, 0.08, size=raw.shape[:2]).astype(np.float16)
        d.flat[0] = 0.0
        d.flat[1] = np.float16(3e-6)  # subnormal in fp16
        raw[:, :, off:off + 2] = d[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def raw_blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype in K_SCALE_OFFSETS:
        return random_k_blocks(qtype, N, K, rng)
    w = rng.standard_normal((N, K)).astype(np.float32) * rng.uniform(0.01, 3.0, size=(N, 1)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (d = 0)
    return gguf_quantize(w, qtype)


@pytest.mark.parametrize("qtype", sorted(REPACKABLE_TYPES, key=lambda q: q.value), ids=lambda q: q.name)
def test_repack_equals_gguf_dequantize_exactly(qtype: Q) -> None:
    raw = raw_blocks(qtype, np.random.default_rng(qtype.value))
    pw = gguf_to_packed(raw, qtype, (N, K), torch.float32)
    assert (pw.out_features, pw.in_features) == (N, K)
    ref = gguf_dequantize(raw, qtype).reshape(N, K)
    np.testing.assert_array_equal(dequantize(pw).numpy(), ref)


@pytest.mark.parametrize("qtype,bits,group,has_min", [(Q.Q4_0, 4, 32, True), (Q.Q4_1, 4, 32, True),
                                                        (Q.Q8_0, 8, 32, False), (Q.Q4_K, 4, 32, True),
                                                        (Q.Q5_K, 8, 32, True), (Q.Q6_K, 8, 16, False)],
                         ids=lambda v: getattr(v, "name", None))
def test_packed_form_per_type(qtype: Q, bits: int, group: int, has_min: bool) -> None:
    pw = gguf_to_packed(raw_blocks(qtype, np.random.default_rng(1)), qtype, (N, K), torch.float32)
    assert (pw.bits, pw.group_size, pw.mins is not None, pw.perm) == (bits, group, has_min, None)
    c = codes(pw)
    lo, hi = {Q.Q5_K: (0, 31), Q.Q6_K: (-32, 31), Q.Q8_0: (-128, 127)}.get(qtype, (0, 15))
    assert lo <= int(c.min()) and int(c.max()) <= hi


def test_q4_0_nibble_order_rearranged() -> None:
    """llama.cpp keeps weights 0-15 of a block in the low nibbles and 16-31 in the high ones; packed.py wants
    columns 2j / 2j + 1 in byte j. Built by hand from known codes, independently of the gguf package."""
    rng = np.random.default_rng(2)
    q = rng.integers(0, 16, size=(3, 64), dtype=np.uint8)  # two blocks per row
    d = np.float16(0.5)
    blocks = []
    for row in q:
        for blk in row.reshape(2, 32):
            nib = blk[:16] | (blk[16:] << 4)
            blocks.append(np.concatenate([np.array([d]).view(np.uint8), nib]))
    raw = np.stack(blocks).reshape(3, -1)
    pw = gguf_to_packed(raw, Q.Q4_0, (3, 64))
    assert torch.equal(codes(pw), torch.from_numpy(q).to(torch.int16))
    assert torch.equal(pw.qweight[:, 0], torch.from_numpy(q[:, 0] | (q[:, 1] << 4)))
    assert torch.equal(pw.scales, torch.full((3, 2), 0.5))
    assert torch.equal(pw.mins, torch.full((3, 2), -4.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", sorted(REPACKABLE_TYPES, key=lambda q: q.value), ids=lambda q: q.name)
def test_compute_dtype_casts_scales_once(qtype: Q, dtype: torch.dtype) -> None:
    """A half-precision compute dtype changes nothing but the rounding of the float32 scales and mins."""
    raw = raw_blocks(qtype, np.random.default_rng(3))
    full = gguf_to_packed(raw, qtype, (N, K), torch.float32)
    half = gguf_to_packed(raw, qtype, (N, K), dtype)
    assert half.dtype == dtype
    assert torch.equal(half.qweight, full.qweight)
    assert torch.equal(half.scales, full.scales.to(dtype))
    assert (half.mins is None) == (full.mins is None)
    if half.mins is not None:
        assert torch.equal(half.mins, full.mins.to(dtype))


def test_float_types_stay_float_and_others_are_refused() -> None:
    x = np.ones((2, 32), np.float32)
    for qtype in (Q.F32, Q.F16, Q.BF16):
        assert gguf_to_packed(x, qtype, (2, 32)) is None
        assert not is_repackable(qtype)
    for qtype in (Q.Q2_K, Q.Q3_K, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ2_XXS):
        block, size = GGML_QUANT_SIZES[qtype]
        with pytest.raises(UnsupportedGGUFType, match=qtype.name) as err:
            gguf_to_packed(np.zeros((2, size), np.uint8), qtype, (2, block))
        assert err.value.ggml_type == qtype
        assert not is_repackable(qtype)


def test_bad_input_names_the_field() -> None:
    raw = gguf_quantize(np.ones((2, 64), np.float32), Q.Q8_0)
    with pytest.raises(ValueError, match="data has 136 bytes"):
        gguf_to_packed(raw, Q.Q8_0, (3, 64))
    with pytest.raises(ValueError, match="in_features 48 is not a multiple"):
        gguf_to_packed(raw, Q.Q8_0, (2, 48))
    with pytest.raises(ValueError, match="shape=.*2-D"):
        gguf_to_packed(raw, Q.Q8_0, (128,))
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        gguf_to_packed(raw, Q.Q8_0, (2, 64), torch.int8)
    with pytest.raises(ValueError, match="ggml_type=9999"):
        gguf_to_packed(raw, 9999, (2, 64))
    with pytest.raises(ValueError, match="data has dtype float32"):
        gguf_to_packed(raw.view(np.float32), Q.Q8_0, (2, 64))


def test_every_tensor_of_the_default_model_repacks_exactly(default_model_path) -> None:
    """SmolLM2-135M-Instruct Q4_1: the loader's quantized path gives, tensor by tensor, the values of its
    dequantizing path (q/k rows un-permuted alike), and the tied LM head packs the embedding's Q8_0 blocks."""
    reader = open_gguf(default_model_path)
    cfg = read_gguf_config(default_model_path)
    assert cfg.tie_word_embeddings
    floats = iter_gguf_tensors(reader, cfg)
    packed = 0
    embedding = None
    for name, w in iter_gguf_tensors(reader, cfg, keep_quantized=True):
        if name == "lm_head.weight":
            assert isinstance(w, PackedWeight) and embedding is not None
            assert torch.equal(dequantize(w), embedding)
            continue
        ref_name, ref = next(floats)
        assert name == ref_name
        if isinstance(w, PackedWeight):
            packed += 1
            w = dequantize(w)
        assert torch.equal(w, ref), name
        if name == "model.embed_tokens.weight":
            embedding = ref
    assert next(floats, None) is None
    quantized = [t for t in reader.tensors if t.tensor_type not in (Q.F32, Q.F16, Q.BF16)]
    assert packed == len(quantized) - 1  # all but the embedding, which stays float
