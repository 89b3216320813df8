"""fp8 W8A8 on fp8 tensor cores: ``torch._scaled_mm`` with per-token and per-channel scales against its float32
twin (the same fp8 operands, dequantized and multiplied), alone, in a ``Linear`` and in a whole model."""
import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs fp8 tensor cores (compute capability >= 8.9)", allow_module_level=True)

from rooflm.layers.custom_op import select_ops  # noqa: E402
from rooflm.layers.linear import Linear, _fp8_scaled_mm, _fp8_twin  # noqa: E402
from rooflm.quantization.fp8 import (fp8_linear_reference, fp8_linear_scaled_mm,  # noqa: E402
                                     quantize_fp8_weight)

pytestmark = pytest.mark.gpu


def _close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.float().abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_scaled_mm_matches_twin(dtype, m):
    torch.manual_seed(0)
    w = torch.randn(192, 256, device="cuda")
    fw = quantize_fp8_weight(w)
    x = torch.randn(m, 256, device="cuda", dtype=dtype)
    bias = torch.randn(192, device="cuda", dtype=dtype)
    out = fp8_linear_scaled_mm(x, fw, bias)
    assert out.dtype == dtype and out.shape == (m, 192)
    # identical fp8 operands on both sides: only the float32 accumulation order and the output rounding differ
    _close(out, fp8_linear_reference(x, fw, bias), 1.5e-2)
    _close(out, torch.nn.functional.linear(x.float(), w, bias.float()), 0.08)  # and close to the float matmul


def test_linear_chooses_scaled_mm_on_the_fast_path_and_the_twin_on_the_reference_path():
    torch.manual_seed(0)
    layer = Linear(128, 64, bias=False).cuda().to(torch.bfloat16)
    layer.weight.data.normal_(0, 0.05)
    layer.set_fp8(quantize_fp8_weight(layer.weight.detach()))
    x = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
    select_ops(layer, "triton")
    assert layer._impl_fn is _fp8_scaled_mm
    fast = layer(x)
    select_ops(layer, "native")
    assert layer._impl_fn is _fp8_twin
    _close(fast, layer(x), 1.5e-2)


def _tiny_fp8_model(tmp_path, dtype: torch.dtype, intermediate: int):
    from rooflm.loader import load_model

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 128,
           "intermediate_size": intermediate, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return load_model(str(tmp_path / "config.json"), dtype=dtype, device="cuda", quantization="fp8",
                      show_progress=False)


def test_fp8_model_on_gpu_matches_its_twin(tmp_path):
    from rooflm.attention.metadata_utils import allocate_kv_caches, single_sequence_metadata

    model, mc = _tiny_fp8_model(tmp_path, torch.bfloat16, 256)
    assert all(m.quant == "fp8" for m in model.modules() if isinstance(m, Linear))
    ids = list(range(3, 20))

    @torch.inference_mode()
    def logits(reference: bool) -> torch.Tensor:
        select_ops(model, "native" if reference else "triton")
        caches = allocate_kv_caches(mc.num_hidden_layers, 8, 4, mc.num_key_value_heads, mc.head_dim,
                                    torch.bfloat16, "cuda")
        meta, pos = single_sequence_metadata(0, len(ids), 4, "cuda")
        return model.compute_logits(model(torch.tensor(ids, device="cuda"), pos, caches, meta))

    fast, twin = logits(False), logits(True)
    _close(fast, twin, 0.05)


def test_fused_norm_and_activation_quantization_give_the_unfused_logits(tmp_path, monkeypatch):
    """On the fast path the RMSNorm before qkv / gate_up and the SiLU-and-mul before down write the fp8 codes the
    matmul reads (one kernel each instead of two): the logits equal those of the unfused pairs bit for bit."""
    import rooflm.layers.activation as act_mod
    import rooflm.layers.norm as norm_mod
    from rooflm.attention.metadata_utils import allocate_kv_caches, single_sequence_metadata

    model, mc = _tiny_fp8_model(tmp_path, torch.float16, 352)
    calls = {"norm": 0, "act": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(norm_mod, "rms_norm_fp8_linear", counted("norm", norm_mod.rms_norm_fp8_linear))
    monkeypatch.setattr(act_mod, "silu_mul_fp8_linear", counted("act", act_mod.silu_mul_fp8_linear))

    @torch.inference_mode()
    def logits(n: int) -> torch.Tensor:
        select_ops(model, "triton")  # the ops read ROOFLM_FUSED_GEMV when they choose
        caches = allocate_kv_caches(mc.num_hidden_layers, 8, 4, mc.num_key_value_heads, mc.head_dim,
                                    torch.float16, "cuda")
        meta, pos = single_sequence_metadata(0, n, 4, "cuda")
        ids = torch.arange(3, 3 + n, device="cuda")
        return model.compute_logits(model(ids, pos, caches, meta))

    for n in (5, 24):  # a few rows (decode-sized) and a prefill
        monkeypatch.setenv("ROOFLM_FUSED_GEMV", "off")
        unfused = logits(n)
        assert calls == {"norm": 0, "act": 0}
        monkeypatch.delenv("ROOFLM_FUSED_GEMV")
        fused = logits(n)
        assert calls["norm"] == 2 * mc.num_hidden_layers and calls["act"] == mc.num_hidden_layers
        calls.update(norm=0, act=0)
        assert torch.equal(fused, unfused)
