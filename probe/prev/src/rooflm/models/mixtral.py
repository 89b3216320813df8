"""Mixtral: the Llama decoder with a sparse mixture-of-experts MLP (top-k routing, SwiGLU experts).

Expert weights are stacked per layer: ``w13`` [experts, 2 * intermediate, hidden] (rows [w1=gate | w3=up]) and
``w2`` [experts, hidden, intermediate], over the experts and intermediate columns this rank holds (all of them on one
rank). ``moe_forward`` here is the plain torch reference (the ``native`` path): it loops on the host over the experts
some token chose. The Triton path runs ``rooflm.kernels.fused_moe`` instead: the pairs are grouped by expert on the
device and two grouped GEMMs compute every chosen expert at once, with no host round trip, so a decode step can be
captured in a CUDA graph. ``ROOFLM_FUSED_MOE=0`` (read when the model is built) keeps the reference loop on the GPU,
with its expert projections on the GEMV kernels, for comparisons.

Tensor parallelism (``rooflm.distributed``): attention splits its heads as in Llama. The experts split one of two
ways, each ending in one all-reduce of the layer's output over the tensor-parallel ranks:

- by default (Megatron-style) every rank holds a slice of every expert: the rows of w1 and w3 and the matching
  columns of w2, ``intermediate / tp`` of them, so each rank computes a partial sum of every routed token's output;
- under expert parallelism (``enable_expert_parallel``; GShard, Lepikhin et al. 2021) rank r holds whole experts
  [r·E/tp, (r+1)·E/tp). The router is replicated, so every rank routes every token the same way; a rank computes only
  the contributions of its own experts (a token routed elsewhere adds zero there) and the all-reduce sums them.

Quantization (``rooflm.quantization``) covers the attention projections (``Linear``) and, if asked, the LM head; the
stacked experts stay float (a quantized weight of a checkpoint is dequantized into them at load time), and so does
the router, whose top-k choice a rounding error would flip (GPTQ and AWQ checkpoints leave it float too).
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from rooflm.config import ModelConfig
from rooflm.distributed.parallel_state import get_ep_rank, get_ep_size, get_tp_rank, get_tp_size, tp_all_reduce
from rooflm.distributed.partition import Shard, expert_range, shard_range
from rooflm.layers.activation import get_gated_activation
from rooflm.layers.custom_op import TRITON, CustomOp
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
    expert_start: int = 0,
) -> torch.Tensor:  # [T, hidden]
    """The weighted sum of each token's chosen experts. ``w13`` and ``w2`` hold experts [expert_start, expert_start +
    w13.shape[0]) (expert parallelism: this rank's share; ``topk_ids`` are global ids): a token's choice of another
    expert adds nothing here."""
    out = torch.zeros_like(x)
    num_local = w13.shape[0]
    for e in torch.unique(topk_ids).tolist():  # only the experts some token chose
        if not expert_start <= e < expert_start + num_local:
            continue  # another rank's expert
        token_idx, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = act_and_mul(linear(x[token_idx], w13[e - expert_start]))  # [n_e, intermediate]
        y = linear(h, w2[e - expert_start])  # [n_e, hidden]
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].to(y.dtype))
    return out


class MixtralMoE(CustomOp):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_local_experts
        self.top_k = cfg.num_experts_per_tok
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        ep, ep_rank = get_ep_size(), get_ep_rank()
        # this rank's experts (all of them unless expert-parallel) and its columns of their intermediate activation
        self.expert_start, self.num_local_experts = expert_range(self.num_experts, ep, ep_rank)
        self.sliced = self.tp_size > 1 and ep == 1  # Megatron-style: a slice of every expert
        self.inter_start, self.intermediate_size = (shard_range(cfg.intermediate_size, self.tp_size, self.tp_rank)
                                                    if self.sliced else (0, cfg.intermediate_size))
        self.gate = Linear(cfg.hidden_size, self.num_experts)  # the router, whole on every rank
        self.gate.keep_float = True  # load-time quantization leaves it float
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate_size, cfg.hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, cfg.hidden_size, self.intermediate_size),
                               requires_grad=False)
        self.act_and_mul = get_gated_activation(cfg.hidden_act)
        # The fused kernel's epilogue is SiLU-and-multiply, the activation of every Mixtral checkpoint.
        self.fused = cfg.hidden_act == "silu" and os.environ.get("ROOFLM_FUSED_MOE", "1") != "0"
        self.reduce_output = True  # False: return this rank's partial sum (the decoder layer's next norm sums it)

    def _experts(self, x: torch.Tensor, linear: Callable | None) -> torch.Tensor:
        """The routed experts' weighted sum: the reference loop with ``linear``, the fused kernels with None."""
        weights, ids = route_topk(self.gate(x), self.top_k)
        if linear is None:
            from rooflm.kernels.fused_moe import fused_moe

            out = fused_moe(x, self.w13, self.w2, weights, ids, self.expert_start, self.num_experts)
        else:
            out = moe_forward(x, self.w13, self.w2, weights, ids, self.act_and_mul, linear, self.expert_start)
        # partial sums (of slices or of experts) added up, here or by the next norm
        return tp_all_reduce(out) if self.tp_size > 1 and self.reduce_output else out

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self._experts(x, linear_native)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self._experts(x, None if self.fused else linear_triton)

    @property
    def waits_on_host(self) -> bool:
        """True when a step of this block asks the GPU which experts were chosen (the reference loop)."""
        return not (self.impl == TRITON and self.fused)

    def is_local_expert(self, e: int) -> bool:
        return self.expert_start <= e < self.expert_start + self.num_local_experts

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """HF Mixtral names: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1/w2/w3``; only this
        rank's experts, cut to its intermediate columns under tensor parallelism without expert parallelism."""
        size = self.intermediate_size
        rows_cut = Shard(0, self.inter_start, size) if self.sliced else None
        cols_cut = Shard(1, self.inter_start, size) if self.sliced else None
        t = {f"{prefix}.gate.weight": WeightTarget(self.gate.weight)}
        for e in range(self.expert_start, self.expert_start + self.num_local_experts):
            p, i = f"{prefix}.experts.{e}", e - self.expert_start
            t[f"{p}.w1.weight"] = WeightTarget(self.w13, (i, slice(0, size)), rows_cut)
            t[f"{p}.w3.weight"] = WeightTarget(self.w13, (i, slice(size, 2 * size)), rows_cut)
            t[f"{p}.w2.weight"] = WeightTarget(self.w2, (i,), cols_cut)
        return t


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_prefix = "block_sparse_moe"

    def make_mlp(self, cfg: ModelConfig) -> nn.Module:
        return MixtralMoE(cfg)


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer

    def other_stage_weight(self, name: str) -> bool:
        """Also true for the experts another expert-parallel rank holds: they are skipped as they stream past."""
        if super().other_stage_weight(name):
            return True
        parts = name.split(".")  # model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight
        if len(parts) > 5 and parts[3] == "block_sparse_moe" and parts[4] == "experts":
            return not self.layers[int(parts[2])].mlp.is_local_expert(int(parts[5]))
        return False


class MixtralForCausalLM(LlamaForCausalLM):
    model_class = MixtralModel

    @property
    def cuda_graph_capturable(self) -> bool:  # type: ignore[override]
        """Only with the fused MoE kernels. The reference ``moe_forward`` picks the chosen experts on the host
        (torch.unique, torch.nonzero): a step synchronizes with the GPU, which a CUDA graph cannot capture. Capturing
        anyway fails, and under tensor parallelism a failed capture leaves PyTorch's allocator and random-number
        state broken on every rank, so such a model decodes eagerly."""
        return not any(m.waits_on_host for m in self.modules() if isinstance(m, MixtralMoE))
