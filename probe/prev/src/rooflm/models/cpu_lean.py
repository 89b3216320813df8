"""A lean forward of the Llama decoder stack for a model on the CPU path.

On a CPU a decode step of a small model spends a large share of its time dispatching small ops from Python: the
SmolLM2-135M step is four packed int4 matmuls per layer plus about forty small torch ops and a dozen module calls,
each costing a few microseconds of Python and dispatcher time. ``run_lean_layers`` computes what the decoder layers
compute, with the same torch ops in the same order (so the same floats, bit for bit), but as one plain loop:

- no ``nn.Module.__call__`` / ``CustomOp`` dispatch per op, and each layer's parts looked up once (a step with a
  forward hook on any of the layers' modules goes through the modules instead);
- a packed int4 projection calls torch's kernel directly (no permutation, split or bias to check per call), and a
  weight in the native kernel's layout (``rooflm.kernels.cpu_native``) calls that kernel directly;
- the bfloat16 result of an int4 ``o_proj`` / ``down_proj`` / ``qkv_proj`` enters the next float32 op as it is:
  type promotion widens it exactly, as the explicit ``.to(float32)`` of the module path does, one op fewer; the
  SiLU product is rounded to bfloat16 as it is stored (``out=``), as ``.to(bfloat16)`` of the float32 product is;
- a single decoding sequence with full attention rotates, writes and attends inline (the CPU backend's maths), with
  the gather of its context replaced by a view when its KV blocks are consecutive (they usually are: the block pool
  hands out fresh blocks in order), which copies nothing;
- so does a single sequence with several new tokens (a speculative verify step, a token tree's, a prefill chunk),
  with its mask built once per step (``rooflm.models.cpu_lean_seq``).

It runs only where every layer took the CPU path (``ops="auto"`` or ``"cpu"`` on the CPU, CPU attention backend),
one tensor-parallel rank, one pipeline stage, a dense SwiGLU MLP, a float KV cache and no H2O score collection;
anything else goes through the modules as before. ``ROOFLM_CPU_LEAN=off`` turns it off (read at every step).
Checked against the module path in ``tests/models/test_cpu_lean.py``.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module

from rooflm.attention.backend import AttentionMetadata
from rooflm.attention.cpu_backend import CpuAttention, _decode, decode_attention
from rooflm.kernels.cpu_native import NativeWeight, native_linear
from rooflm.kernels.cpu_quant import COMPUTE_DTYPE, quant_linear_cpu
from rooflm.layers.activation import SiluAndMul
from rooflm.layers.custom_op import CPU, impl_generation
from rooflm.layers.norm import cpu_rms_norm
from rooflm.models.cpu_lean_seq import SeqStep, attend_seq, consecutive, rotate_and_write, seq_step_applies
from rooflm.models.cpu_lean_stack import NativeStack

_int4mm = torch.ops.aten._weight_int4pack_mm_for_cpu


LEAN_MODES = ("on", "ops", "off")


def lean_mode() -> str:
    """``ROOFLM_CPU_LEAN``: ``on`` (default), ``ops`` (the per-operator loop, without the native decode layers of
    ``rooflm.models.cpu_lean_stack``) or ``off`` (the module-by-module forward)."""
    mode = os.environ.get("ROOFLM_CPU_LEAN", "on").strip().lower() or "on"
    if mode not in LEAN_MODES:
        raise ValueError(f"ROOFLM_CPU_LEAN={mode!r} is not supported: expected one of {', '.join(LEAN_MODES)}")
    return mode


def lean_allowed_by_env() -> bool:
    """``ROOFLM_CPU_LEAN=off`` keeps the CPU path on the module-by-module forward."""
    return lean_mode() != "off"


class _Plan(list):
    """The layers' parts, and the native decode layers made from them on first use (False: not applicable)."""

    stack: NativeStack | bool | None = None


def _fast_int4(lin) -> tuple | NativeWeight | None:
    """(packed weight, group size, scales) when ``lin`` multiplies with a plain packed int4 weight, which torch's
    kernel can take as it is; the ``NativeWeight`` of a weight on the native kernel (float32 in and out, as the
    module path computes it); else None."""
    cw = lin._cpu_weight
    if cw is None or cw.split or cw.perm is not None or lin.bias is not None or lin.quant != "packed":
        return None
    if cw.kind == "native":
        return cw.native
    return (cw.weight, cw.group_size, cw.scales) if cw.kind == "int4" else None


def _linear_ok(lin) -> bool:
    return lin.impl == CPU and (lin.quant is None or (lin.quant == "packed" and lin._cpu_weight is not None))


def lean_plan(model) -> list | None:
    """One entry per layer when the whole stack of ``model`` (a ``LlamaModel``) can run lean, else None. Kept on
    the model until an op re-chooses its implementation (``select_ops``, a quantized weight set or moved). A forward
    hook or pre-hook on any module of the layers (calibration statistics, weight offload) sends the step to the
    modules, which run it: checked at every step, on the modules' hook dictionaries themselves (registering a hook
    adds to them), kept with the plan. For SmolLM2-135M's 420 modules that takes 15 us where a step's weights have
    just gone through the caches, against 130 us for reading the two attributes of each module."""
    if not lean_allowed_by_env() or model.pp_size != 1:
        return None
    key = (impl_generation(), len(model.layers))
    cached = model.__dict__.get("_lean_plan")
    if cached is None or cached[0] != key:
        hooks = tuple(d for layer in model.layers for m in layer.modules()
                      for d in (m._forward_hooks, m._forward_pre_hooks))
        cached = (key, _build_plan(model), hooks)
        model.__dict__["_lean_plan"] = cached
    _, plan, hooks = cached
    if plan is None or _hooked(hooks):
        return None
    return plan


def _hooked(hooks: tuple) -> bool:
    """Whether a global forward (pre-)hook is set or any of the dictionaries ``hooks`` holds one."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(hooks)


def _build_plan(model) -> list | None:
    from rooflm.models.llama import LlamaDecoderLayer  # a subclass with its own forward is not this maths

    layer_forward = LlamaDecoderLayer.forward
    plan = _Plan()
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (layer.mlp_norm_gate_up is None or attn.tp_size != 1 or mlp.tp_size != 1
                or not isinstance(attn.attn.backend, CpuAttention) or layer.input_layernorm.impl != CPU
                or layer.post_attention_layernorm.impl != CPU or not isinstance(mlp.act_and_mul, SiluAndMul)
                or type(layer).forward is not layer_forward):
            return None
        lins = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(_linear_ok(lin) for lin in lins):
            return None
        plan.append(_Layer(layer))
    return plan


class _Layer:
    """One decoder layer's parts, looked up once: a module attribute lookup costs about as much as a small op's
    dispatch. Parameters are held as the objects themselves, so weights loaded or moved in place are seen."""

    __slots__ = ("w1", "eps1", "w2", "eps2", "shape", "qkv", "o", "gate_up", "down", "fast", "attn", "hq", "hkv",
                 "d", "q_size", "kv_size", "window")

    def __init__(self, layer) -> None:
        sa, mlp = layer.self_attn, layer.mlp
        self.w1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.w2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self.shape = tuple(self.w1.shape)
        self.qkv, self.o, self.gate_up, self.down = sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj
        self.fast = tuple(_fast_int4(lin) for lin in (self.qkv, self.o, self.gate_up, self.down))
        self.attn = sa.attn
        self.hq, self.hkv, self.d = sa.num_heads, sa.num_kv_heads, sa.head_dim
        self.q_size, self.kv_size = sa.q_size, sa.kv_size
        self.window = sa.attn.sliding_window


def _proj(x: torch.Tensor, lin, fast: tuple | NativeWeight | None) -> torch.Tensor:
    """``lin(x)``; a fast int4 projection returns its bfloat16 product (the caller widens it), a native one float32,
    the others x's dtype."""
    if fast is not None:
        if type(fast) is NativeWeight:
            return native_linear(x, fast).to(x.dtype)
        return _int4mm(x.to(COMPUTE_DTYPE), *fast)
    if lin.quant is None:
        return F.linear(x, lin.weight, lin.bias)
    return quant_linear_cpu(x, lin._cpu_weight, lin.bias)


def _add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``x + residual`` in the residual's dtype. A bfloat16 ``x`` (an int4 product) is widened exactly either way:
    inside the add for a few rows (one op fewer), by a cast first for many (torch's mixed-dtype add is not
    vectorised: about 15% slower from 256 rows of 576)."""
    if x.dtype != residual.dtype and x.shape[0] > 64:
        x = x.to(residual.dtype)
    return x + residual


class _DecodeOne:
    """What every layer of a step with one decoding sequence (full attention) shares: the rotary tables, the slot
    the new token's K/V go to and, when the context's blocks are consecutive, where its K and V start in a layer's
    cache (each layer's cache has the same shape, so the same offsets)."""

    def __init__(self, backend: CpuAttention, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        self.cos2, self.sin2 = backend._rope_tables(cos, sin)
        self.backend = backend
        self.slots = meta.slot_mapping
        self.blocks = backend._decode_blocks
        self.seq_len = meta.seq_lens_cpu[0]
        self.view = None  # (size, stride, K offset, V offset) of the context as [1, Hkv, L, D] views
        if consecutive(self.blocks):
            _, _, bs, hkv, d = kv_cache.shape
            start = int(self.blocks[0]) * bs * hkv * d
            self.view = ((1, hkv, self.seq_len, d), (hkv * self.seq_len * d, d, hkv * d, 1), start,
                         start + kv_cache.stride(0))
        self.act = None  # the bfloat16 input of the down projection, reused by every layer


def _attend_one(step: _DecodeOne, attn, qkv: torch.Tensor, hq: int, hkv: int, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
    """Rotary, cache write and attention of the one decoding sequence: the CPU backend's maths, in fewer ops.
    ``qkv`` [1, q | k | v] may be the bfloat16 product: the rotary products widen it to float32 exactly, as the
    explicit cast of the module path does. Returns [1, Hq, D]."""
    d = attn.head_dim
    qk = rotate_and_write(step, qkv, hq, hkv, d, kv_cache, meta)
    q = qk[:, :hq]
    if step.view is None:
        return _decode(q, kv_cache, meta, attn.scale, step.blocks, step.backend._decode_blocks_range)
    size, stride, k_off, v_off = step.view
    base = kv_cache.storage_offset()  # a cache may be a view into a larger buffer
    k = kv_cache.as_strided(size, stride, base + k_off)
    v = kv_cache.as_strided(size, stride, base + v_off)
    return decode_attention(q, k[0].transpose(0, 1), v[0].transpose(0, 1), attn.scale)


def run_lean_layers(plan: list, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                    sin: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decoder layers of ``plan`` over (hidden, residual), as the layers' ``forward`` computes them; None (and
    nothing computed) when this step needs what the lean path leaves to the modules."""
    if meta.attn_scores is not None or not all(type(c) is torch.Tensor and c.dtype == hidden.dtype
                                                and c.is_contiguous() for c in kv_caches):
        return None
    dtype = hidden.dtype
    backend: CpuAttention = plan[0].attn.backend
    backend._step(meta, kv_caches[0].shape[2])
    one = seq = None
    if (meta.is_decode_only and meta.num_seqs == 1 and meta.tree_masks is None and backend._slots_valid
            and backend._decode_blocks is not None and dtype == torch.float32):
        one = _DecodeOne(backend, cos, sin, kv_caches[0], meta)
        if lean_mode() == "on":  # one native call per layer where the whole stack takes it (not "ops")
            if plan.stack is None:
                plan.stack = NativeStack.build(plan) or False
            out = plan.stack.run(one, hidden, residual, kv_caches) if plan.stack else None
            if out is not None:
                return out
    elif seq_step_applies(meta, backend, dtype):
        seq = SeqStep(backend, cos, sin, kv_caches[0], meta)
    for lay, kv_cache in zip(plan, kv_caches, strict=True):
        f_qkv, f_o, f_gu, f_down = lay.fast
        # attention block: residual += hidden; qkv = qkv_proj(rms_norm(residual))
        if residual is None:
            residual = hidden
        else:
            residual = _add(hidden, residual)
        qkv = _proj(cpu_rms_norm(residual, lay.w1, lay.eps1), lay.qkv, f_qkv)
        T = qkv.shape[0]
        if one is not None and lay.window is None:
            out = _attend_one(one, lay.attn, qkv, lay.hq, lay.hkv, kv_cache, meta)
        elif seq is not None and lay.window is None:
            out = attend_seq(seq, lay.attn, qkv, lay.hq, lay.hkv, kv_cache)
        else:
            q, k, v = qkv.to(dtype).split([lay.q_size, lay.kv_size, lay.kv_size], dim=-1)
            out = lay.attn.forward_native(q.view(T, lay.hq, lay.d), k.view(T, lay.hkv, lay.d),
                                          v.view(T, lay.hkv, lay.d), cos, sin, kv_cache, meta)
        hidden = _proj(out.reshape(T, lay.q_size), lay.o, f_o)
        # MLP block: residual += attention output; down(silu(gate) * up) of gate_up_proj(rms_norm(residual))
        residual = _add(hidden, residual)
        gate_up = _proj(cpu_rms_norm(residual, lay.w2, lay.eps2), lay.gate_up, f_gu)
        gate, up = gate_up.chunk(2, dim=-1)
        if type(f_down) is tuple and one is not None:
            # silu in float32, the product rounded to bfloat16 as it is stored: what ``.to(bfloat16)`` of the
            # float32 product gives, without the float32 intermediate
            if one.act is None or one.act.shape != up.shape:
                one.act = torch.empty(up.shape, dtype=COMPUTE_DTYPE)
            act = torch.mul(F.silu(gate.to(dtype)), up, out=one.act)
        else:
            act = F.silu(gate.to(dtype)) * up.to(dtype)
        hidden = _proj(act, lay.down, f_down)
    return hidden.to(dtype), residual
