"""Mixtral: the Llama decoder with a sparse mixture-of-experts MLP (top-k routing, SwiGLU experts).

Expert weights are stacked per layer: ``w13`` [num_experts, 2 * intermediate, hidden] (rows [w1=gate | w3=up]) and
``w2`` [num_experts, hidden, intermediate]. The routing and expert loop here is the plain torch reference; a fused
MoE kernel can replace ``moe_forward`` behind the same signature. On the Triton path the expert projections of small
batches go to the GEMV kernels (``linear_triton``) and the activation is the fused ``SiluAndMul``.

Quantization (``rooflm.quantization``) covers the attention projections (``Linear``) and, if asked, the LM head; the
stacked experts stay float (a quantized weight of a checkpoint is dequantized into them at load time), and so does
the router, whose top-k choice a rounding error would flip (GPTQ and AWQ checkpoints leave it float too).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rooflm.config import ModelConfig
from rooflm.layers.activation import get_gated_activation
from rooflm.layers.custom_op import CustomOp
from rooflm.layers.linear import Linear, linear_native, linear_triton
from rooflm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from rooflm.models.weights import WeightTarget


def route_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, num_experts] -> (weights [T, top_k] float32, renormalised to sum 1; expert ids [T, top_k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def moe_forward(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [E, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [E, hidden, intermediate]
    topk_weights: torch.Tensor,  # [T, top_k] float32
    topk_ids: torch.Tensor,  # [T, top_k]
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = linear_native,
) -> torch.Tensor:  # [T, hidden]
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():  # only the experts some token chose
        token_idx, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = act_and_mul(linear(x[token_idx], w13[e]))  # [n_e, intermediate]
        y = linear(h, w2[e])  # [n_e, hidden]
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].to(y.dtype))
    return out


class MixtralMoE(CustomOp):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_local_experts
        self.top_k = cfg.num_experts_per_tok
        self.intermediate_size = cfg.intermediate_size
        self.gate = Linear(cfg.hidden_size, self.num_experts)  # the router
        self.gate.keep_float = True  # load-time quantization leaves it float
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size, cfg.intermediate_size),
                               requires_grad=False)
        self.act_and_mul = get_gated_activation(cfg.hidden_act)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = route_topk(self.gate(x), self.top_k)
        return moe_forward(x, self.w13, self.w2, weights, ids, self.act_and_mul, linear_native)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(self.gate(x), self.top_k)
        return moe_forward(x, self.w13, self.w2, weights, ids, self.act_and_mul, linear_triton)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """HF Mixtral names: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1/w2/w3``."""
        size = self.intermediate_size
        t = {f"{prefix}.gate.weight": WeightTarget(self.gate.weight)}
        for e in range(self.num_experts):
            p = f"{prefix}.experts.{e}"
            t[f"{p}.w1.weight"] = WeightTarget(self.w13, (e, slice(0, size)))
            t[f"{p}.w3.weight"] = WeightTarget(self.w13, (e, slice(size, 2 * size)))
            t[f"{p}.w2.weight"] = WeightTarget(self.w2, (e,))
        return t


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_prefix = "block_sparse_moe"

    def make_mlp(self, cfg: ModelConfig) -> nn.Module:
        return MixtralMoE(cfg)


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_class = MixtralModel
