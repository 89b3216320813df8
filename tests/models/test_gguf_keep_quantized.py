"""The GGUF loader's quantized path on small files written with ``gguf.GGUFWriter``: which tensors come out packed,
that each decodes to the dequantizing path's values (q/k rows un-permuted, experts split, tied LM head packed),
the fallback for block formats without a packed form, and the stored weight bytes."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter
from gguf.quants import quantize

from rooflm.loader.gguf import (gguf_weight_bytes, iter_gguf_tensors, open_gguf, unpermute_qk,
                                unpermute_qk_packed)
from rooflm.quantization.gguf_repack import gguf_to_packed
from rooflm.quantization.packed import PackedWeight, dequantize

HIDDEN, HEADS, KV_HEADS, VOCAB, EXPERTS, EXPERT_FFN = 256, 4, 2, 48, 3, 64
CFG = SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
# fp16 super-block scale offsets (d, dmin) inside each block of the types built from random bytes.
RANDOM_BLOCK_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82)}


def random_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Block bytes of a torch-order ``shape`` tensor: gguf's own quantizer where it has one, else random valid
    bytes with finite fp16 scales."""
    if qtype not in RANDOM_BLOCK_SCALES:
        return quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for off in RANDOM_BLOCK_SCALES[qtype]:
        d = rng.uniform(-0.05, 0.05, size=raw.shape[:-1]).astype(np.float16)
        raw[..., off:off + 2] = d[..., None].view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def write_gguf(path: str, tensors: dict[str, tuple[Q, tuple[int, ...]]], seed: int = 0) -> int:
    """Writes a llama-architecture GGUF with the given (type, torch shape) tensors; returns their stored bytes."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    stored = 0
    for name, (qtype, shape) in tensors.items():
        if qtype == Q.F32:
            raw = rng.standard_normal(shape).astype(np.float32)
            writer.add_tensor(name, raw)
        else:
            raw = random_blocks(qtype, shape, rng)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        stored += raw.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


TIED = {
    "token_embd.weight": (Q.Q8_0, (VOCAB, HIDDEN)),
    "blk.0.attn_norm.weight": (Q.F32, (HIDDEN,)),
    "blk.0.attn_q.weight": (Q.Q4_K, (HIDDEN, HIDDEN)),
    "blk.0.attn_k.weight": (Q.Q6_K, (KV_HEADS * HIDDEN // HEADS, HIDDEN)),
    "blk.0.attn_v.weight": (Q.Q5_K, (KV_HEADS * HIDDEN // HEADS, HIDDEN)),
    "blk.0.attn_output.weight": (Q.Q4_0, (HIDDEN, HIDDEN)),
    "blk.0.ffn_gate_inp.weight": (Q.F32, (EXPERTS, HIDDEN)),
    "blk.0.ffn_gate_exps.weight": (Q.Q4_1, (EXPERTS, EXPERT_FFN, HIDDEN)),
    "blk.0.ffn_up_exps.weight": (Q.Q2_K, (EXPERTS, EXPERT_FFN, HIDDEN)),  # no packed form: dequantized
    "blk.0.ffn_down.weight": (Q.Q2_K, (HIDDEN, HIDDEN)),
    "output_norm.weight": (Q.F32, (HIDDEN,)),
}
PACKED = {"lm_head.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
          "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
          *(f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(EXPERTS))}


@pytest.fixture(scope="module")
def tied_file(tmp_path_factory) -> tuple[str, int]:
    path = str(tmp_path_factory.mktemp("gguf") / "tied.gguf")
    return path, write_gguf(path, TIED)


def test_keep_quantized_matches_the_dequantizing_path(tied_file) -> None:
    path, _ = tied_file
    reader = open_gguf(path)
    floats = dict(iter_gguf_tensors(reader, CFG))
    kept = dict(iter_gguf_tensors(reader, CFG, keep_quantized=True))
    assert all(isinstance(w, torch.Tensor) for w in floats.values())
    assert set(kept) == set(floats) | {"lm_head.weight"}
    assert {name for name, w in kept.items() if isinstance(w, PackedWeight)} == PACKED
    for name, w in kept.items():
        ref = floats["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        got = dequantize(w) if isinstance(w, PackedWeight) else w
        assert got.dtype == torch.float32 and torch.equal(got, ref), name


def test_packed_q_k_rows_are_unpermuted_like_the_float_weight(tied_file) -> None:
    """The permutation acts on rows only, so un-permuting codes, scales and mins commutes with dequantizing;
    a weight left in llama.cpp's row order would differ (random rows are never permutation-invariant)."""
    path, _ = tied_file
    reader = open_gguf(path)
    kept = dict(iter_gguf_tensors(reader, CFG, keep_quantized=True))
    q = kept["model.layers.0.self_attn.q_proj.weight"]
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    stored = gguf_to_packed(raw.data, raw.tensor_type, (HIDDEN, HIDDEN))
    assert not torch.equal(dequantize(stored), dequantize(q))
    assert torch.equal(dequantize(unpermute_qk_packed(stored, HEADS)), unpermute_qk(dequantize(stored), HEADS))
    assert torch.equal(dequantize(q), unpermute_qk(dequantize(stored), HEADS))


def test_compute_dtype_and_fallback_logged_once(tied_file, caplog) -> None:
    path, _ = tied_file
    with caplog.at_level(logging.WARNING, logger="rooflm.loader.gguf"):
        kept = dict(iter_gguf_tensors(open_gguf(path), CFG, keep_quantized=True, dtype=torch.float16))
    fallbacks = [r for r in caplog.records if "Q2_K" in r.getMessage()]
    assert len(fallbacks) == 1  # two Q2_K tensors, one message
    assert kept["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert all(w.dtype == torch.float16 for w in kept.values() if isinstance(w, PackedWeight))
    assert kept["model.embed_tokens.weight"].dtype == torch.float32


def test_untied_file_keeps_its_own_head(tmp_path) -> None:
    path = str(tmp_path / "untied.gguf")
    tensors = {"token_embd.weight": (Q.Q4_0, (VOCAB, HIDDEN)), "output.weight": (Q.Q6_K, (VOCAB, HIDDEN)),
               "output_norm.weight": (Q.F32, (HIDDEN,))}
    stored = write_gguf(path, tensors)
    reader = open_gguf(path)
    kept = list(iter_gguf_tensors(reader, CFG, keep_quantized=True))
    floats = dict(iter_gguf_tensors(reader, CFG))
    assert [name for name, _ in kept] == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    head = dict(kept)["lm_head.weight"]
    assert isinstance(head, PackedWeight) and torch.equal(dequantize(head), floats["lm_head.weight"])
    assert gguf_weight_bytes(path) == stored
    embed = tensors["token_embd.weight"][1]
    embed_bytes = embed[0] * embed[1] // 32 * GGML_QUANT_SIZES[Q.Q4_0][1]
    assert gguf_weight_bytes(path, streamed_only=True) == stored - embed_bytes


def test_weight_bytes_of_a_tied_file_count_the_embedding(tied_file) -> None:
    path, stored = tied_file
    assert gguf_weight_bytes(path) == gguf_weight_bytes(path, streamed_only=True) == stored
