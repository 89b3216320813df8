"""On CUDA, ``RotaryEmbedding.use_device_table`` makes cos / sin a lookup in a table built by the same operations
the per-step path runs: the looked-up rows must equal the computed ones bit for bit, for each dtype and for scaled
RoPE, at positions anywhere below the bound (and they arrive as two views of one row stride)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from rooflm.layers.rotary import RotaryEmbedding  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_lookup_equals_the_computed_cos_sin_bit_for_bit(dtype, scaling):
    computed = RotaryEmbedding(128, 500000.0, scaling).cuda()
    looked_up = RotaryEmbedding(128, 500000.0, scaling).cuda()
    looked_up.use_device_table(8192, dtype)
    g = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.tensor([0, 1, 8191]), torch.randint(0, 8192, (500,), generator=g)]).cuda()
    for a, b in zip(computed.cos_sin(positions, dtype), looked_up.cos_sin(positions, dtype)):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    cos, sin = looked_up.cos_sin(positions, dtype)
    assert cos.stride(0) == sin.stride(0) == 128 and cos.stride(1) == 1
    other = looked_up.cos_sin(positions, torch.float16 if dtype != torch.float16 else torch.float32)  # computed
    assert other[0].is_contiguous()
