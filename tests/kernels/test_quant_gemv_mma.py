"""The tensor-core layout of 4-bit weights (rooflm/kernels/quant_gemv_mma.py) on the CPU: ``pack_mma`` read back
through the mma's fragment order (``unpack_mma``) gives every code at its row and column, and weights the layout
cannot hold are refused with an error that names what is wrong. The kernel itself needs CUDA (PTX with ``mma.sync``):
tests/gpu/test_gpu_quant_gemv_mma.py."""
from __future__ import annotations

import pytest
import torch

from test_quant_gemm import make_packed


@pytest.mark.parametrize("n,k,group", [(16, 128, 128), (48, 512, 128), (32, 768, 256), (16, 384, 384)])
def test_pack_mma_puts_every_code_in_its_fragment(n, k, group):
    from rooflm.kernels.quant_gemv_mma import pack_mma, unpack_mma
    from rooflm.quantization.packed import codes

    pw = make_packed(n, k, 4, group, mins=True, perm=False, dtype=torch.float16, device="cpu")
    words = pack_mma(pw)
    assert words.dtype == torch.int32 and tuple(words.shape) == (n // 16, 2 * k)
    assert torch.equal(unpack_mma(words, n, k), codes(pw).to(torch.int64))


def test_pack_mma_in_row_chunks(monkeypatch):
    """A weight converted a few rows at a time (as large ones are) gives the same words as in one piece."""
    from rooflm.kernels import quant_gemv_mma

    pw = make_packed(80, 256, 4, 128, mins=True, perm=False, dtype=torch.float16, device="cpu")
    whole = quant_gemv_mma.pack_mma(pw)
    monkeypatch.setattr(quant_gemv_mma, "_PACK_CODES", 32 * 256)  # 32 rows a chunk: 32, 32, 16
    assert torch.equal(quant_gemv_mma.pack_mma(pw), whole)


def test_pack_mma_first_word_by_hand():
    """Thread 5 (g = 1, t = 1) of block 0, k-step 0: nibbles W[1, 2], W[9, 2], W[1, 10], W[9, 10] at bits 0-15 and
    the next column of each at bits 16-31 (the A fragment of mma.m16n8k16 with this layout's column order)."""
    from rooflm.kernels.quant_gemv_mma import pack_mma
    from rooflm.quantization.packed import PackedWeight, pack_int4

    q = (torch.arange(16 * 128).view(16, 128) * 7 + torch.arange(16)[:, None]) % 16
    pw = PackedWeight(pack_int4(q), torch.ones(16, 1, dtype=torch.float16), None, 4, 128)
    word = int(pack_mma(pw)[0, 5 * 4]) & 0xFFFFFFFF  # block 0, group 0, half 0, thread 5, k-step 0
    cols = [32, 32, 40, 40, 33, 33, 41, 41]  # 32 t + 8 half + e, t = 1
    rows = [1, 9, 1, 9, 1, 9, 1, 9]
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [int(q[r, c]) for r, c in zip(rows, cols)]


@pytest.mark.parametrize("bits,n,k,group,dtype,field", [
    (8, 16, 128, 128, torch.float16, "bits=8"),
    (4, 24, 128, 128, torch.float16, "24 x 128"),
    (4, 16, 192, 64, torch.float16, "group_size=64"),
    (4, 16, 128, 128, torch.bfloat16, "torch.bfloat16"),
])
def test_pack_mma_refuses_what_it_cannot_lay_out(bits, n, k, group, dtype, field):
    from rooflm.kernels.quant_gemv_mma import pack_mma, supports_mma

    pw = make_packed(n, k, bits, group, mins=bits == 4, perm=False, dtype=dtype, device="cpu")
    assert not supports_mma(pw)
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        pack_mma(pw)


def test_mma_config_rejects_bad_values():
    from rooflm.kernels.quant_gemv_mma import MmaGemvConfig

    for kw, msg in [({"warps": 3}, "warps=3"), ({"warps": 0}, "warps=0"), ({"split_k": 0}, "split_k=0")]:
        with pytest.raises(ValueError, match=msg):
            MmaGemvConfig(**kw)


def test_with_mma_leaves_cpu_weights_and_the_env_switch_is_checked(monkeypatch):
    """``with_mma`` lays out only CUDA weights (the kernel is PTX); ROOFLM_QUANT_MMA takes 0 or 1 and names itself."""
    from rooflm.kernels.quant_gemv_mma import mma_enabled, with_mma

    pw = make_packed(16, 128, 4, 128, mins=True, perm=False, dtype=torch.float16, device="cpu")
    assert with_mma(pw) is pw and pw.mma is None
    monkeypatch.delenv("ROOFLM_QUANT_MMA", raising=False)
    assert not mma_enabled()  # off unless asked for: the layout is a second copy of the codes
    monkeypatch.setenv("ROOFLM_QUANT_MMA", "1")
    assert mma_enabled()
    assert with_mma(pw) is pw  # still a CPU weight
    monkeypatch.setenv("ROOFLM_QUANT_MMA", "yes")
    with pytest.raises(ValueError, match="ROOFLM_QUANT_MMA"):
        mma_enabled()


def test_the_word_gemv_entry_refuses_a_tensor_core_configuration_without_its_layout():
    """``quant_gemv.launch_gemv`` hands an ``MmaGemvConfig`` to the tensor-core GEMV, which says what is missing
    (here ``pw.mma``) rather than reading a layout that is not there."""
    from rooflm.kernels.quant_gemv import launch_gemv
    from rooflm.kernels.quant_gemv_mma import MmaGemvConfig

    pw = make_packed(16, 128, 4, 128, mins=True, perm=False, dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match="pw.mma"):
        launch_gemv(torch.randn(1, 128).half(), pw, None, MmaGemvConfig())
