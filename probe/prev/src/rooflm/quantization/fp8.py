"""FP8 W8A8 linear layers (float8 e4m3, Micikevicius et al. 2022), as vLLM's ``quantization="fp8"``.

- weights: float8_e4m3fn [N, K] with one float32 scale per output channel, ``w ~ w_fp8 * scale[n]``, quantized by
  round-to-nearest at load time from the float weight (``quantize_fp8_weight``);
- activations: quantized per token at run time (dynamic): ``x ~ x_fp8 * scale_x[m]`` with ``scale_x[m] =
  max|x[m, :]| / 448``;
- matmul: ``torch._scaled_mm(x_fp8, w_fp8.T, scale_a=scale_x [M, 1], scale_b=scale_w [1, N])`` on GPUs with fp8
  tensor cores (compute capability >= 8.9: Ada, Hopper), which accumulates in float32 and applies both scales;
  ``fp8_linear_reference`` is its twin (dequantize both operands in float32 and multiply), used on the CPU and as
  the oracle of the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
FP8_MIN_CAPABILITY = (8, 9)
_MIN_SCALE = 1e-12  # an all-zero row or token keeps a finite scale
# The widest row the quantization kernels take (``rooflm.kernels.fp8_quant``: one program holds a row in registers).
QUANT_KERNEL_MAX_ROW = 65536


@dataclass
class Fp8Weight:
    """weight float8_e4m3fn [N, K]; scale float32 [N] (one per output channel)."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D {FP8_DTYPE} tensor, got {self.weight.dtype} "
                             f"{tuple(self.weight.shape)}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.weight.shape[0],):
            raise ValueError(f"scale must be float32 of shape ({self.weight.shape[0]},), got {self.scale.dtype} "
                             f"{tuple(self.scale.shape)}")
        # The views ``torch._scaled_mm`` takes, made once: at a prefill's 128 projections the two view operations per
        # call are host time the GPU waits for.
        self.weight_t = self.weight.t()  # column-major [K, N]: the second operand's required layout
        self.scale_row = self.scale[None, :]  # [1, N]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: the fp8 codes and the scales."""
        return self.weight.numel() + self.scale.numel() * 4


def fp8_supported(device: torch.device | str) -> bool:
    """True when ``torch._scaled_mm`` can multiply fp8 operands on ``device``: a CUDA device of compute capability
    >= 8.9. False on the CPU (the twin runs there)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def check_fp8_device(device: torch.device | str) -> None:
    """ValueError naming ``quantization`` for a CUDA device without fp8 tensor cores (the CPU runs the twin)."""
    device = torch.device(device)
    if device.type == "cuda" and not fp8_supported(device):
        cap = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
        raise ValueError(f"quantization='fp8' needs a GPU of compute capability >= 8.9 (Ada, Hopper); {device} has "
                         f"{cap}: use 'w8a16' instead")


def quantize_fp8_weight(w: torch.Tensor) -> Fp8Weight:
    """Float w [N, K] -> fp8 codes and per-output-channel float32 scales (``max|w[n]| / 448``)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(weight=q, scale=scale)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 codes [M, K], float32 scales [M, 1]), one scale per row (token). On a CUDA device one
    Triton kernel (``rooflm.kernels.fp8_quant``) does it in a single pass; ``quantize_fp8_per_token_reference`` is
    its twin, bit for bit."""
    if x.is_cuda and x.dim() == 2:
        from rooflm.kernels.fp8_quant import MAX_ROW, quantize_rows_fp8
        if x.shape[1] <= MAX_ROW:
            return quantize_rows_fp8(x, FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    return quantize_fp8_per_token_reference(x)


def quantize_fp8_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch operators of the per-token quantization: scale = max|x[m]| / 448 (at least 1e-12), codes =
    round-to-nearest-even of clamp(x / scale, +-448)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear_reference(x: torch.Tensor, fw: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with both operands rounded to fp8 as the GPU path rounds them, multiplied in float32.
    x [M, K] -> [M, N] in x's dtype."""
    xq, sx = quantize_fp8_per_token(x)
    y = (xq.float() * sx) @ (fw.weight.float() * fw.scale[:, None]).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_shape_ok(fw: Fp8Weight) -> bool:
    """``torch._scaled_mm`` needs both matrix dimensions of the weight to be multiples of 16."""
    return fw.in_features % 16 == 0 and fw.out_features % 16 == 0


def fp8_linear_scaled_mm(x: torch.Tensor, fw: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``fp8_linear_reference``, on fp8 tensor cores (``torch._scaled_mm`` with row-wise scales,
    accumulating in float32 and writing x's dtype)."""
    lead = x.shape[:-1]
    xq, sx = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))
    return fp8_matmul(xq, sx, fw, bias, x.dtype).reshape(*lead, fw.out_features)


def fp8_matmul(xq: torch.Tensor, sx: torch.Tensor, fw: Fp8Weight, bias: torch.Tensor | None,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq * sx) @ (W * scale).T + bias`` on fp8 tensor cores, from activations already quantized per token:
    xq [M, K] fp8 codes, sx [M, 1] float32 -> [M, N] in ``out_dtype``."""
    # _scaled_mm wants the second operand column-major: w_fp8.T of a row-major [N, K] weight is exactly that.
    y = torch._scaled_mm(xq, fw.weight_t, scale_a=sx, scale_b=fw.scale_row, out_dtype=out_dtype)
    return y if bias is None else y + bias


def rms_norm_fp8_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                        fw: Fp8Weight, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8_linear_scaled_mm(rms_norm(x [+ residual])), x [+ residual])`` with the norm and the activations'
    quantization in one kernel (``rooflm.kernels.fp8_quant.rms_norm_quantize_fp8``): the same codes and scales,
    hence the same result, one launch and one float16 round trip fewer. x [M, K] on a CUDA device."""
    from rooflm.kernels.fp8_quant import rms_norm_quantize_fp8

    xq, sx, res = rms_norm_quantize_fp8(x, norm_weight, eps, residual, FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    return fp8_matmul(xq, sx, fw, bias, x.dtype), res


def silu_mul_fp8_linear(gate_up: torch.Tensor, fw: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``fp8_linear_scaled_mm(silu_and_mul(gate_up))`` with the activation and the quantization in one kernel
    (``rooflm.kernels.fp8_quant.silu_and_mul_quantize_fp8``). gate_up [M, 2 * d] on a CUDA device."""
    from rooflm.kernels.fp8_quant import silu_and_mul_quantize_fp8

    xq, sx = silu_and_mul_quantize_fp8(gate_up, FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    return fp8_matmul(xq, sx, fw, bias, gate_up.dtype)
