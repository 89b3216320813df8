"""GPTQ and AWQ tensor layouts: hand-built words in the documented bit orders, and round trips to PackedWeight."""
import pytest
import torch

from rooflm.quantization import rtn
from rooflm.quantization.formats import (
    IntQuant, awq_to_packed, from_awq, from_gptq, from_packed, gptq_to_packed, packed_to_awq, packed_to_gptq, to_awq,
    to_gptq,
)
from rooflm.quantization.packed import dequantize, quant_linear_reference

ONE = torch.ones(1, 1)


def test_gptq_qweight_packs_input_columns_low_nibble_first():
    # output 0 has codes 3 1 4 1 5 9 2 6 on its eight input features: feature j in bits [4j, 4j + 4) of one word
    codes = torch.zeros(8, 8, dtype=torch.int16)
    codes[0] = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    q = IntQuant(codes=codes, scales=torch.ones(8, 1), zeros=torch.full((8, 1), 8, dtype=torch.int16), bits=4,
                 group_size=8)
    t = to_gptq(q)
    assert t["qweight"].shape == (1, 8) and t["qweight"].dtype == torch.int32
    assert t["qweight"][0].tolist() == [0x62951413] + [0] * 7
    hand = torch.zeros(1, 8, dtype=torch.int32)
    hand[0, 0] = 0x62951413
    back = from_gptq(hand, t["qzeros"], t["scales"], None, 4, 8)
    assert torch.equal(back.codes, codes)


def test_gptq_qweight_words_run_down_the_input_dimension():
    # 16 input features: word (i, n) holds features 8i..8i+7 of output n
    codes = (torch.arange(16, dtype=torch.int16) % 16).repeat(8, 1)
    q = IntQuant(codes=codes, scales=torch.ones(8, 1), zeros=torch.ones(8, 1, dtype=torch.int16), bits=4,
                 group_size=16)
    qw = to_gptq(q)["qweight"]
    assert qw.shape == (2, 8)
    words = [[w & 0xFFFFFFFF for w in row] for row in qw.tolist()]
    assert words == [[0x76543210] * 8, [0xFEDCBA98] * 8]
    assert qw[1, 0].item() < 0  # the top nibble sets the sign bit of the int32


def test_gptq_qzeros_pack_output_columns_and_store_zero_minus_one():
    zeros = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.int16).t()  # [N=8, groups=1]
    q = IntQuant(codes=torch.zeros(8, 8, dtype=torch.int16), scales=torch.ones(8, 1), zeros=zeros, bits=4,
                 group_size=8)
    assert to_gptq(q, "gptq")["qzeros"].tolist() == [[0x76543210]]  # output n in bits [4n, 4n + 4), z - 1
    v2 = to_gptq(q, "gptq_v2")["qzeros"].item() & 0xFFFFFFFF
    assert v2 == 0x87654321
    back = from_gptq(to_gptq(q)["qweight"], torch.tensor([[0x76543210]], dtype=torch.int32), torch.ones(1, 8,
                     dtype=torch.float16), None, 4, 8, "gptq")
    assert back.zeros.t().tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]


def test_gptq_classic_format_rejects_a_zero_point_of_zero():
    q = IntQuant(codes=torch.zeros(8, 8, dtype=torch.int16), scales=torch.ones(8, 1),
                 zeros=torch.zeros(8, 1, dtype=torch.int16), bits=4, group_size=8)
    with pytest.raises(ValueError, match="zero point of 0"):
        to_gptq(q, "gptq")
    assert to_gptq(q, "gptq_v2")["qzeros"].tolist() == [[0]]


def test_gptq_8bit_packs_four_bytes_low_first():
    codes = torch.zeros(4, 4, dtype=torch.int16)
    codes[0] = torch.tensor([0x11, 0x22, 0x33, 0xF4])
    zeros = torch.tensor([[128], [1], [2], [255]], dtype=torch.int16)
    q = IntQuant(codes=codes, scales=torch.ones(4, 1), zeros=zeros, bits=8, group_size=4)
    t = to_gptq(q)
    assert t["qweight"].shape == (1, 4) and t["qweight"][0, 0].item() & 0xFFFFFFFF == 0xF4332211
    assert t["qzeros"].shape == (1, 1) and t["qzeros"].item() & 0xFFFFFFFF == 0xFE01007F  # z - 1, output n in byte n
    back = from_gptq(t["qweight"], torch.tensor([[0xFE01007F - (1 << 32)]], dtype=torch.int32), t["scales"], None,
                     8, 4)
    assert torch.equal(back.codes, codes) and torch.equal(back.zeros, zeros)


def test_awq_packs_output_columns_in_interleaved_order():
    # one input feature, eight outputs with codes 0..7: nibble j holds output column [0, 2, 4, 6, 1, 3, 5, 7][j]
    q = IntQuant(codes=torch.arange(8, dtype=torch.int16).reshape(8, 1), scales=torch.ones(8, 1),
                 zeros=torch.arange(8, dtype=torch.int16).reshape(8, 1) + 8, bits=4, group_size=1)
    t = to_awq(q)
    assert t["qweight"].shape == (1, 1) and t["qweight"].item() == 0x75316420
    assert t["qzeros"].item() & 0xFFFFFFFF == 0xFDB9ECA8  # zeros 8..15 in the same order, stored as they are
    back = from_awq(torch.tensor([[0x75316420]], dtype=torch.int32), t["qzeros"], t["scales"], 4, 1)
    assert back.codes.t().tolist() == [list(range(8))]
    assert back.zeros.t().tolist() == [list(range(8, 16))]


def _random_int(n, k, g, bits, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.int16)
    zeros = torch.randint(1, 2 ** bits, (n, k // g), generator=gen, dtype=torch.int16)
    scales = (torch.rand(n, k // g, generator=gen) + 0.01).half().float()
    return codes, scales, zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gptq_4bit_round_trip_equals_rtn_pack(dtype):
    codes, scales, zeros = _random_int(16, 64, 32, 4)
    t = to_gptq(IntQuant(codes, scales, zeros, 4, 32))
    assert t["qweight"].shape == (8, 16) and t["qzeros"].shape == (2, 2) and t["scales"].shape == (2, 16)
    pw = gptq_to_packed(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 32, dtype)
    ref = rtn.pack(codes.to(torch.uint8), scales, zeros.float(), 4, 32, dtype)
    assert pw.perm is None and pw.bits == 4
    assert torch.equal(pw.qweight, ref.qweight) and torch.equal(pw.scales, ref.scales)
    assert torch.equal(pw.mins, ref.mins)


def test_gptq_8bit_round_trip_of_symmetric_codes_equals_rtn_pack():
    w = torch.randn(8, 64)
    ref = rtn.quantize_rtn(w, 8, 32, dtype=torch.float16)  # symmetric int8: no mins
    t = packed_to_gptq(ref)
    assert t["qweight"].shape == (16, 8)
    pw = gptq_to_packed(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 8, 32, torch.float16)
    assert pw.mins is None
    assert torch.equal(pw.qweight, ref.qweight) and torch.equal(pw.scales, ref.scales)


def test_gptq_8bit_asymmetric_round_trip_keeps_the_values():
    codes, scales, zeros = _random_int(8, 64, 16, 8, seed=3)
    iq = IntQuant(codes, scales, zeros, 8, 16)
    t = to_gptq(iq)
    pw = gptq_to_packed(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 8, 16, torch.float32)
    assert torch.allclose(dequantize(pw), iq.dequantize(), rtol=0, atol=1e-5)
    assert torch.equal(from_packed(pw).codes, codes) and torch.equal(from_packed(pw).zeros, zeros)


def test_awq_round_trip_equals_rtn_pack():
    codes, scales, zeros = _random_int(16, 64, 32, 4, seed=1)
    t = to_awq(IntQuant(codes, scales, zeros, 4, 32))
    assert t["qweight"].shape == (64, 2) and t["qzeros"].shape == (2, 2) and t["scales"].shape == (2, 16)
    pw = awq_to_packed(t["qweight"], t["qzeros"], t["scales"], 4, 32, torch.float16)
    ref = rtn.pack(codes.to(torch.uint8), scales, zeros.float(), 4, 32, torch.float16)
    assert torch.equal(pw.qweight, ref.qweight) and torch.equal(pw.mins, ref.mins)
    again = packed_to_awq(pw)
    assert all(torch.equal(again[k], t[k]) for k in t)


def test_rtn_packed_weight_written_as_gptq_reads_back_equal():
    pw = rtn.quantize_rtn(torch.randn(24, 128), 4, 64, dtype=torch.float16)
    t = packed_to_gptq(pw, "gptq_v2")
    back = gptq_to_packed(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 64, torch.float16, "gptq_v2")
    assert torch.equal(back.qweight, pw.qweight) and torch.equal(back.scales, pw.scales)
    # rtn rounded -s * z to float16 from the float32 scale; the checkpoint only has the float16 scale
    assert torch.allclose(back.mins.float(), pw.mins.float(), rtol=1e-3, atol=0)


def test_act_order_g_idx_becomes_a_sorting_permutation():
    k, g = 32, 8
    codes, scales, zeros = _random_int(8, k, g, 4, seed=2)
    g_idx = torch.randperm(k, generator=torch.Generator().manual_seed(0)) // g  # every group has 8 features
    iq = IntQuant(codes, scales, zeros, 4, g, g_idx=g_idx)
    t = to_gptq(iq)
    assert torch.equal(t["g_idx"], g_idx.int())
    pw = gptq_to_packed(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, g, torch.float32)
    assert torch.equal(pw.perm, torch.argsort(g_idx, stable=True))
    assert torch.allclose(dequantize(pw), iq.dequantize(), atol=1e-6)
    x = torch.randn(3, k)
    assert torch.allclose(quant_linear_reference(x, pw), x @ iq.dequantize().t(), atol=1e-4)
    back = from_packed(pw)  # and back to checkpoint tensors with a g_idx
    assert torch.allclose(back.dequantize(), iq.dequantize(), atol=1e-6)
    with pytest.raises(ValueError, match="no g_idx"):
        to_awq(iq)


def test_unbalanced_g_idx_is_rejected():
    codes, scales, zeros = _random_int(4, 16, 8, 4)
    g_idx = torch.tensor([0] * 9 + [1] * 7)
    with pytest.raises(ValueError, match="g_idx"):
        IntQuant(codes, scales, zeros, 4, 8, g_idx=g_idx).to_packed(torch.float32)


def test_bad_shapes_name_the_tensor():
    t = to_gptq(IntQuant(*_random_int(16, 64, 32, 4), 4, 32))
    with pytest.raises(ValueError, match="scales"):
        gptq_to_packed(t["qweight"], t["qzeros"], t["scales"][:1], t["g_idx"], 4, 32, torch.float32)
    with pytest.raises(ValueError, match="qzeros"):
        gptq_to_packed(t["qweight"], t["qzeros"][:, :1], t["scales"], t["g_idx"], 4, 32, torch.float32)
    with pytest.raises(ValueError, match="g_idx"):
        gptq_to_packed(t["qweight"], t["qzeros"], t["scales"], t["g_idx"][:-1], 4, 32, torch.float32)
    with pytest.raises(ValueError, match="bits=3"):
        gptq_to_packed(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 3, 32, torch.float32)
    with pytest.raises(ValueError, match="checkpoint_format"):
        gptq_to_packed(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 32, torch.float32, "marlin")
    a = to_awq(IntQuant(*_random_int(16, 64, 32, 4), 4, 32))
    with pytest.raises(ValueError, match="bits=8"):
        awq_to_packed(a["qweight"], a["qzeros"], a["scales"], 8, 32, torch.float32)
    with pytest.raises(ValueError, match="qzeros"):
        awq_to_packed(a["qweight"], a["qzeros"][:1], a["scales"], 4, 32, torch.float32)


def test_mins_without_integer_zero_points_cannot_be_written():
    pw = rtn.quantize_rtn(torch.randn(8, 32), 4, 32, dtype=torch.float32)
    pw.mins = pw.mins + 0.3 * pw.scales  # a GGUF Q4_1-like min
    with pytest.raises(ValueError, match="integer zero point"):
        packed_to_gptq(pw)
