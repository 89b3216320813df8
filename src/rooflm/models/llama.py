"""The Llama family: Llama 1/2/3 (MHA, GQA, MQA; RoPE incl. llama3 scaling), Mistral (sliding-window attention) and
Qwen2 (q/k/v bias). One decoder for all three; the config decides the differences.

Weights are FUSED: one ``qkv_proj`` ([q | k | v] rows) and one ``gate_up_proj`` ([gate | up] rows) per layer;
``load_weights`` stacks the separate Hugging Face tensors into them.

Data flow (no padding, no batch dimension): T tokens of any number of sequences,
  input_ids [T] -> hidden [T, hidden] -> decoder layers (residual stream kept apart) -> final norm -> [T, hidden].

Every op with a fast path (projections, norms, activation, attention backend) chose its implementation when the
model was built: build it inside ``rooflm.layers.custom_op.op_selection`` (the loader does), or re-choose with
``select_ops``.

Tensor parallelism (``rooflm.distributed``): built inside an initialised process group, each rank holds its share of
the heads (``qkv_proj`` and ``o_proj``), of the MLP columns (``gate_up_proj`` and ``down_proj``) and of the
vocabulary; ``o_proj`` and ``down_proj`` are row-parallel and their outputs are summed over the ranks (one
all-reduce each). Pipeline parallelism (``rooflm.distributed.pipeline``): each rank builds only its stage's layers
(the others are ``MissingLayer`` placeholders), receives the activations from the previous stage and sends them to the
next; the first stage embeds, the last normalises and computes the logits, which every stage receives. At one rank
every collective is the identity.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from rooflm.attention.backend import AttentionMetadata
from rooflm.config import ModelConfig
from rooflm.distributed.parallel_state import (get_ep_size, get_pp_rank, get_pp_size, get_tp_rank, get_tp_size,
                                              tp_all_reduce)
from rooflm.distributed.pipeline import (MissingLayer, pp_layer_range, receive_activations, send_activations,
                                         share_logits)
from rooflm.distributed.partition import Shard, check_tensor_parallel, head_shard, narrow_weight, shard_range
from rooflm.kernels._utils import DOWN_TO_QKV, O_TO_GATE_UP, HandoffLaunch
from rooflm.layers.activation import SiluAndMul, SiluAndMulLinear, get_gated_activation
from rooflm.layers.attention import Attention
from rooflm.layers.embedding import LMHead, VocabEmbedding
from rooflm.layers.linear import GEMV_MAX_ROWS, Linear
from rooflm.layers.norm import AllReduceRMSNorm, NormHandoff, RMSNorm, RMSNormLinear
from rooflm.layers.rotary import RotaryEmbedding
from rooflm.models.cpu_lean import lean_plan, run_lean_layers
from rooflm.models.weights import WeightTarget, load_named_weights, rows
from rooflm.quantization.packed import PackedWeight


def layer_sliding_window(cfg: ModelConfig, layer_idx: int) -> int | None:
    """The attention window of one layer: None for full attention. HF configs with ``layer_types`` (Qwen2) choose
    per layer; otherwise ``sliding_window`` applies to every layer (Mistral)."""
    if cfg.sliding_window is None:
        return None
    layer_types = cfg.hf_config.get("layer_types")
    if layer_types:
        return cfg.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
    return cfg.sliding_window


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.heads = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, self.tp_size, self.tp_rank)
        self.num_heads = self.heads.num_heads  # this rank's share
        self.num_kv_heads = self.heads.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # HF Llama's attention_bias also covers o_proj; Qwen2's q/k/v bias does not.
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias and cfg.model_type == "llama")
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              sliding_window=layer_sliding_window(cfg, layer_idx))
        # False: return this rank's partial sum (the decoder layer's next norm sums it over the ranks)
        self.reduce_output = True

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim // 2]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        return self.attend(self.qkv_proj(hidden), cos, sin, kv_cache, meta)

    def attend(
        self,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size]: the output of qkv_proj
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        out = self.o_proj(self.attention_output(qkv, cos, sin, kv_cache, meta))
        return tp_all_reduce(out) if self.tp_size > 1 and self.reduce_output else out

    def attention_output(self, qkv, cos, sin, kv_cache, meta) -> torch.Tensor:  # [T, q_size]: o_proj's input
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        # The backend rotates q, k, writes k, v into the paged cache, then attends over the cache.
        return self.attn(q, k, v, cos, sin, kv_cache, meta)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """HF names ``{prefix}.q_proj.weight`` etc. -> row ranges of the fused qkv_proj."""
        t: dict[str, WeightTarget] = {}
        hd, tp = self.head_dim, self.tp_size > 1
        q_cut = Shard(0, self.heads.q_start * hd, self.q_size) if tp else None  # this rank's heads
        kv_cut = Shard(0, self.heads.kv_start * hd, self.kv_size) if tp else None
        shards = (("q_proj", 0, self.q_size, q_cut), ("k_proj", self.q_size, self.kv_size, kv_cut),
                  ("v_proj", self.q_size + self.kv_size, self.kv_size, kv_cut))
        for name, start, size, cut in shards:
            t[f"{prefix}.{name}.weight"] = WeightTarget(self.qkv_proj.weight, rows(start, size), cut)
            if self.qkv_proj.bias is not None:
                t[f"{prefix}.{name}.bias"] = WeightTarget(self.qkv_proj.bias, rows(start, size), cut)
        # row-parallel: the input columns of this rank's heads; the bias is added once (rank 0)
        o_cut = Shard(1, self.heads.q_start * hd, self.q_size) if tp else None
        t[f"{prefix}.o_proj.weight"] = WeightTarget(self.o_proj.weight, shard=o_cut)
        if self.o_proj.bias is not None:
            bias_cut = Shard(zero=True) if self.tp_rank else None
            t[f"{prefix}.o_proj.bias"] = WeightTarget(self.o_proj.bias, shard=bias_cut)
        return t


class LlamaMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)), with gate and up fused into one projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        # this rank's columns of the intermediate activation
        self.inter_start, self.intermediate_size = shard_range(cfg.intermediate_size, self.tp_size, self.tp_rank)
        bias = bool(cfg.hf_config.get("mlp_bias", False))  # Llama option, off in every released model
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=bias)  # rows: [gate | up]
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=bias)
        self.act_and_mul = get_gated_activation(cfg.hidden_act)
        # down_proj(act_and_mul(.)); on the Triton path one GEMV at decode sizes
        self.act_down = SiluAndMulLinear(self.act_and_mul, self.down_proj)
        self.reduce_output = True  # False: return this rank's partial sum (as LlamaAttention's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        act = self.gate_up_act(x)
        return self.project(act) if act is not None else self.down(self.gate_up_proj(x))  # via [T, 2 * inter]

    def gate_up_act_config(self, x: torch.Tensor):
        """The GEMV configuration that computes act(gate) * up of gate_up_proj(x) with the activation as its
        epilogue, where the Triton path takes the rows (decode sizes with a float weight, one row of a packed one on
        CUDA) and that was measured faster than the GEMV followed by the activation kernel; None otherwise."""
        proj = self.gate_up_proj
        if not (self.act_down.fuse and isinstance(self.act_and_mul, SiluAndMul) and not proj.fp8_tensor_cores
                and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS):
            return None
        if proj.quantized:  # one row of a packed weight on CUDA: the word GEMV's epilogue
            pw = proj.packed_weight
            if pw is None or not x.is_cuda or x.shape[0] != 1:
                return None
            from rooflm.kernels.quant_gemv import pick_gemv_silu_mul as pick_packed

            return pick_packed(x, pw, proj.bias)
        from rooflm.kernels.fused_gemv import pick_gemv_silu_mul

        return pick_gemv_silu_mul(x, proj.weight, proj.bias)

    def gate_up_act(self, x: torch.Tensor) -> torch.Tensor | None:
        """act(gate) * up from one GEMV (see ``gate_up_act_config``); None where that does not apply."""
        cfg = self.gate_up_act_config(x)
        if cfg is None:
            return None
        proj = self.gate_up_proj
        if proj.quantized:
            from rooflm.kernels.quant_gemv import gemv_silu_mul as packed_silu_mul

            return packed_silu_mul(x, proj.packed_weight, proj.bias, cfg)
        from rooflm.kernels.fused_gemv import gemv_silu_mul

        return gemv_silu_mul(x, proj.weight, proj.bias, cfg)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, projected down; summed over the tensor-parallel ranks (row-parallel down_proj)."""
        out = self.act_down(gate_up)
        return tp_all_reduce(out) if self.tp_size > 1 and self.reduce_output else out

    def project(self, act: torch.Tensor) -> torch.Tensor:
        """``down`` of an input already through the activation."""
        out = self.down_proj(act)
        return tp_all_reduce(out) if self.tp_size > 1 and self.reduce_output else out

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        size, tp = self.intermediate_size, self.tp_size > 1
        col_cut = Shard(0, self.inter_start, size) if tp else None
        down_cuts = {"weight": Shard(1, self.inter_start, size) if tp else None,
                     "bias": Shard(zero=True) if self.tp_rank else None}
        t: dict[str, WeightTarget] = {}
        for kind in ("weight", "bias") if self.down_proj.bias is not None else ("weight",):
            t[f"{prefix}.gate_proj.{kind}"] = WeightTarget(getattr(self.gate_up_proj, kind), rows(0, size), col_cut)
            t[f"{prefix}.up_proj.{kind}"] = WeightTarget(getattr(self.gate_up_proj, kind), rows(size, size), col_cut)
            t[f"{prefix}.down_proj.{kind}"] = WeightTarget(getattr(self.down_proj, kind), shard=down_cuts[kind])
        return t


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels beside the hidden states so each norm can fuse the add before it:
    the layer returns (mlp output, residual) and the NEXT norm adds them. Each norm is called together with the
    projection after it (``RMSNormLinear``), which the Triton path runs as one GEMV at decode sizes.

    Under tensor parallelism the attention and MLP outputs stay partial sums and each norm after them sums them over
    the ranks (``AllReduceRMSNorm``: all-reduce, add and norm in one kernel on the GPU): the layer's input is partial
    whenever ``residual`` is given (the previous layer's output, or the previous pipeline stage's), and the model's
    final norm sums the last layer's. Only the embeddings (``residual`` None) arrive whole."""

    mlp_prefix = "mlp"  # the HF module name of the feed-forward block

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg)
        self.attn_norm_qkv = RMSNormLinear(self.input_layernorm, self.self_attn.qkv_proj)
        # a dense SwiGLU MLP starts with gate_up_proj; another feed-forward block (Mixtral's MoE) takes the norm alone
        self.mlp_norm_gate_up = (RMSNormLinear(self.post_attention_layernorm, self.mlp.gate_up_proj)
                                 if isinstance(self.mlp, LlamaMLP) else None)
        self.tp = get_tp_size() > 1
        # the next layer's input norm and qkv_proj on this pipeline stage, for _down's handoff (set by the model; a
        # plain tuple, so not a second name for that module)
        self.next_norm_qkv: tuple[RMSNormLinear, ...] = ()
        # a dense SwiGLU MLP without tensor parallelism: its projections may hand the norms' adds on (_handoff)
        self.handoff_allowed = (not self.tp and isinstance(self.mlp, LlamaMLP)
                                and isinstance(self.mlp.act_and_mul, SiluAndMul))
        if self.tp:
            self.self_attn.reduce_output = self.mlp.reduce_output = False
            self.reduce_input_norm = AllReduceRMSNorm(self.input_layernorm)
            self.reduce_post_attention_norm = AllReduceRMSNorm(self.post_attention_layernorm)

    def make_mlp(self, cfg: ModelConfig) -> nn.Module:
        return LlamaMLP(cfg)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden]; None before the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp:
            return self._forward_tp(hidden, residual, cos, sin, kv_cache, meta)
        # Programmatic dependent launch at one row (the attention backend's choice; see
        # rooflm/kernels/handoff_gemv.py for the measurements): every kernel of the layer is launched while the one
        # before it drains and waits for it in place. qkv_proj lets decode attention in at its start; o_proj is
        # resident while attention runs and loads its first weight tile before it waits, and lets gate_up_proj in at
        # its start; gate_up_proj and down_proj let the next kernel in after their main loops; gate_up_proj and the
        # next layer's qkv_proj load their first weight tile before they wait.
        pdl = self.self_attn.attn.backend.programmatic_launch
        if isinstance(hidden, NormHandoff):  # the previous layer's down_proj did the add (see _down)
            qkv = self.attn_norm_qkv.from_handoff(hidden, **(DOWN_TO_QKV.consumer() if pdl else {}))
            residual = hidden.residual
        else:
            qkv, residual = self.attn_norm_qkv(hidden, residual)  # residual None (first layer): the embeddings
        attn = self.self_attn.attention_output(qkv, cos, sin, kv_cache, meta)
        hand = self._handoff(attn, self.self_attn.o_proj, residual, self.mlp_norm_gate_up, True,
                             O_TO_GATE_UP if pdl else None)
        if hand is not None:  # o_proj did the add; gate_up_proj the norm and the activation
            mlp = self._fused_mlp(hand, pdl)
            if mlp is not None:  # gate_up_proj to down_proj in one kernel, the next norm handed over
                return mlp, mlp.residual
            act = self.mlp_norm_gate_up.from_handoff(hand, silu_mul=True, **(O_TO_GATE_UP.consumer() if pdl else {}))
            return self._down(act, hand.residual, pdl)
        hidden = self.self_attn.o_proj(attn)
        if self.mlp_norm_gate_up is not None:
            fused = self.mlp_norm_gate_up.norm_gemv_silu_mul(hidden, residual)  # one row: norm to activation
            if fused is not None:
                return self._down(fused[0], fused[1])
            if self.mlp.gate_up_act_config(hidden) is None:  # no activation in gate_up's GEMV: RMSNormLinear's
                gate_up, residual = self.mlp_norm_gate_up(hidden, residual)  # choice (maybe the norm in it)
                return self.mlp.down(gate_up), residual
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self._down(self.mlp.gate_up_act(hidden), residual)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def _handoff(self, x: torch.Tensor, proj: Linear, residual: torch.Tensor | None, after: RMSNormLinear | None,
                 silu_mul: bool, launch: HandoffLaunch | None = None) -> NormHandoff | None:
        """proj(x) + residual as a ``NormHandoff`` for ``after`` (the norm and projection that follow), where one row
        runs on the Triton path with float (or two packed) weights and the handoff was measured faster
        (``pick_handoff``, ``pick_handoff_packed``); None otherwise. ``launch``: programmatic dependent launch of the
        pair (proj's kernel here, after's by the caller), under which both picks time the pair."""
        if (after is None or residual is None or x.shape[0] != 1 or not self.handoff_allowed
                or proj.fp8_tensor_cores or not after.handoff_ready() or residual.shape != (1, proj.out_features)):
            return None
        from rooflm.kernels import handoff_gemv as hg

        norm, nxt = after._parts
        if proj.quantized != nxt.quantized:
            return None
        if proj.quantized:  # two packed weights: the word GEMV's epilogue and scale (rooflm/kernels/quant_gemv.py)
            pw = proj.packed_weight
            pick = (hg.pick_handoff_packed(x, pw, proj.bias, nxt.packed_weight, nxt.bias, norm.eps, silu_mul, launch)
                    if pw is not None and x.is_cuda else None)
            if pick is None:
                return None
            y, h, sumsq = hg.packed_add_sumsq(x, pw, proj.bias, pick[0], residual, norm.weight,
                                              **(launch.producer() if launch else {}))
        else:
            pick = hg.pick_handoff(x, proj.weight, proj.bias, nxt.weight, nxt.bias, norm.eps, silu_mul, launch)
            if pick is None:
                return None
            y, h, sumsq = hg.gemv_add_sumsq(x, proj.weight, proj.bias, pick[0], residual, norm.weight,
                                            **(launch.producer() if launch else {}))
        return NormHandoff(h, y, sumsq, pick[1])

    def _fused_mlp(self, hand: NormHandoff, pdl: bool) -> NormHandoff | None:
        """The MLP of packed weights from ``hand`` in one kernel and a reduction that hands the next norm over
        (``rooflm.kernels.quant_mlp.layer_mlp``), where measured faster than its two word GEMVs; None otherwise."""
        if not (self.next_norm_qkv and self.mlp.gate_up_proj.quantized and self.next_norm_qkv[0].handoff_ready()):
            return None
        from rooflm.kernels.quant_mlp import layer_mlp

        norm, qkv = self.next_norm_qkv[0]._parts
        out = layer_mlp(hand.scaled, hand.sumsq, hand.config, hand.residual, self.post_attention_layernorm.eps,
                        self.mlp.gate_up_proj, self.mlp.down_proj, norm, qkv, pdl)
        return None if out is None else NormHandoff(*out)

    def _down(self, act: torch.Tensor, residual: torch.Tensor,
              pdl: bool = False) -> tuple[torch.Tensor | NormHandoff, torch.Tensor]:
        """down_proj(act) and the residual stream; a ``NormHandoff`` for the next layer where ``_handoff`` applies.
        ``pdl``: act comes from the handed-over gate_up_proj, which lets down_proj's kernel in after its main loop."""
        nxt = self.next_norm_qkv[0] if self.next_norm_qkv else None
        hand = self._handoff(act, self.mlp.down_proj, residual, nxt, False, DOWN_TO_QKV if pdl else None)
        if hand is not None:
            return hand, hand.residual
        return self.mlp.project(act), residual

    def _forward_tp(self, hidden, residual, cos, sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` on one tensor-parallel rank: partial sums in and out (see the class docstring)."""
        if residual is None:  # the embeddings, already whole
            qkv, residual = self.attn_norm_qkv(hidden, None)
        else:
            h, residual = self.reduce_input_norm(hidden, residual)
            qkv = self.self_attn.qkv_proj(h)
        partial = self.self_attn.attend(qkv, cos, sin, kv_cache, meta)
        h, residual = self.reduce_post_attention_norm(partial, residual)
        return self.mlp(h), residual

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        t = {
            f"{prefix}.input_layernorm.weight": WeightTarget(self.input_layernorm.weight),
            f"{prefix}.post_attention_layernorm.weight": WeightTarget(self.post_attention_layernorm.weight),
        }
        t.update(self.self_attn.weight_targets(f"{prefix}.self_attn"))
        t.update(self.mlp.weight_targets(f"{prefix}.{self.mlp_prefix}"))
        return t


class LlamaModel(nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.num_hidden_layers
        self.pp_size, self.pp_rank = get_pp_size(), get_pp_rank()
        self.start_layer, self.end_layer = pp_layer_range(n, self.pp_size, self.pp_rank)  # this stage's layers
        self.is_first, self.is_last = self.start_layer == 0, self.end_layer == n
        self.hidden_size = cfg.hidden_size
        # the last stage keeps the embedding too when the LM head is tied to it
        keep_embed = self.is_first or (self.is_last and cfg.tie_word_embeddings)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if keep_embed else None
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) if self.start_layer <= i < self.end_layer
                                    else MissingLayer() for i in range(n))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        stage = [layer for layer in self.layers if not isinstance(layer, MissingLayer)]
        for layer, nxt in zip(stage, stage[1:]):
            if isinstance(layer, LlamaDecoderLayer) and isinstance(nxt, LlamaDecoderLayer):
                layer.next_norm_qkv = (nxt.attn_norm_qkv,)
        # under tensor parallelism the last layer's output is a partial sum (see LlamaDecoderLayer)
        self.reduce_norm = AllReduceRMSNorm(self.norm) if get_tp_size() > 1 else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_caches: list[torch.Tensor],  # one [2, num_blocks, block_size, num_kv_heads, head_dim] per layer of the stage
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] (on a stage before the last: its layers' output, already sent on)
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = receive_activations(input_ids.shape[0], self.hidden_size, self.norm.weight.dtype,
                                                   self.pp_rank)
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        # the CPU path: the same maths without per-op module dispatch (rooflm.models.cpu_lean), where it applies
        plan = lean_plan(self) if hidden.device.type == "cpu" else None
        lean = run_lean_layers(plan, hidden, residual, cos, sin, kv_caches, meta) if plan else None
        if lean is not None:
            hidden, residual = lean
        else:
            for layer, kv_cache in zip(self.layers[self.start_layer:self.end_layer], kv_caches, strict=True):
                hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        if not self.is_last:
            send_activations(hidden, residual, self.pp_rank)
            return hidden
        if self.reduce_norm is not None and residual is not None:
            hidden, _ = self.reduce_norm(hidden, residual)
        else:
            hidden, _ = self.norm(hidden, residual)
        return hidden

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        t = {f"{prefix}.norm.weight": WeightTarget(self.norm.weight)}
        if self.embed_tokens is not None:
            t[f"{prefix}.embed_tokens.weight"] = WeightTarget(self.embed_tokens.weight, shard=self.embed_tokens.shard)
        for i in range(self.start_layer, self.end_layer):
            t.update(self.layers[i].weight_targets(f"{prefix}.layers.{i}"))
        return t

    def other_stage_weight(self, name: str) -> bool:
        """True for a checkpoint tensor (HF name) that another pipeline stage loads."""
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            return not self.start_layer <= i < self.end_layer
        return name.startswith("model.embed_tokens.") and self.embed_tokens is None


class LlamaForCausalLM(nn.Module):
    """The model interface the engine calls (see docs/architecture.md)."""

    model_class = LlamaModel
    cuda_graph_capturable = True  # a decode step never waits on the host (worker/cuda_graphs.py)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_tensor_parallel(config, get_tp_size(), expert_parallel=get_ep_size() > 1)
        self.config = config
        self.model = self.model_class(config)
        tie = self.model.embed_tokens if config.tie_word_embeddings else None
        # only the last pipeline stage computes logits
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tie_to=tie) if self.model.is_last else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (pass only the rows to sample from). Every pipeline stage gets the last
        stage's logits."""
        logits = self.lm_head(hidden) if self.lm_head is not None else None
        return share_logits(logits, hidden.shape[0], self.config.vocab_size, hidden.device, self.model.pp_size)

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every HF tensor name this model expects, mapped to where it goes."""
        t = self.model.weight_targets("model")
        if self.lm_head is not None and not self.lm_head.tied:
            t["lm_head.weight"] = WeightTarget(self.lm_head.weight, shard=self.lm_head.shard)
        return t

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> None:
        """Load HF-named tensors (any dtype; cast on copy) or quantized ``PackedWeight``s (kept packed in the
        projections, see ``rooflm.models.weights``). Raises ValueError on a missing tensor or a shape mismatch."""
        optional = ("lm_head.weight",) if self.lm_head is None or self.lm_head.tied else ()
        load_named_weights(self.weight_targets(), self._packed_tied_head(weights), optional=optional, model=self)

    def _packed_tied_head(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]):
        """A checkpoint may quantize the output projection even when it ties it to the embedding (a GGUF file keeps
        ``token_embd`` in its quantized blocks and uses it for both): the tied head then holds that packed weight
        itself, while the embedding keeps the float copy lookups need."""
        for name, tensor in weights:
            if self.model.other_stage_weight(name):
                continue
            if name == "lm_head.weight" and self.lm_head is not None and self.lm_head.tied and isinstance(
                    tensor, PackedWeight):
                shard = self.lm_head.shard
                self.lm_head.set_packed(tensor if shard is None else narrow_weight(tensor, shard))
                continue
            yield name, tensor


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with sliding-window attention (``config.sliding_window``), applied by the attention backend."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v projection bias (``config.attention_bias``, true for Qwen2) and per-layer window choice."""
