"""The decoder layers of a one-token CPU decode step, one native call per layer.

The lean loop (``rooflm.models.cpu_lean``) already calls the native operators directly, but between them each layer
still pays about fifteen Python-level calls (argument checks, views, allocations, ctypes conversions): on a 2-core
machine with a slow Python that was about 10 of SmolLM2-135M's 15 ms per token, where llama.cpp, which evaluates the
step as one graph in C, takes 10 ms in all. Here the work from one layer's SiLU product to the next layer's is one
call of ``decode_segment`` (``rooflm/kernels/cpu_native/decode.c``): the previous layer's down projection and
residual add, the norm, the qkv projection, rotary embedding and cache write, attention over the paged cache, the o
projection, the residual add, the norm and the gate_up projection. The SiLU product in between is torch's, in place
on the step's buffers, and everything else is the same native function the per-operator path calls with the same
arguments: the floats are those of the lean loop and of the modules, bit for bit (``tests/models/test_cpu_lean.py``).

It takes a step of one decoding sequence with full attention on a float32 model whose four projections per layer are
all on the native kernel; anything else goes to the lean loop. Arguments are checked once per step (slot and block
table against the cache), not once per layer. ``ROOFLM_CPU_LEAN=ops`` keeps the per-operator lean loop.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from rooflm.kernels.cpu_native import NativeWeight, native_linear

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _LayerArgs(ctypes.Structure):  # decode_layer in decode.c
    _fields_ = [("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P), ("norm1", _P), ("norm2", _P), ("eps1", _F),
                ("eps2", _F), ("kcache", _P), ("vcache", _P)]


class _StepArgs(ctypes.Structure):  # decode_step in decode.c
    _fields_ = [("hidden", _I64), ("hq", _I64), ("hkv", _I64), ("d", _I64), ("scale", _F), ("cos2", _P),
                ("sin2", _P), ("slot", _I64), ("nkeys", _I64), ("blocks", _P), ("block_size", _I64),
                ("nthreads", _I64), ("residual", _P), ("act", _P), ("normed", _P), ("qkv", _P), ("qk", _P),
                ("attn", _P), ("proj", _P), ("gate_up", _P)]


def _float32_vector(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.dim() == 1 and t.is_contiguous()


class NativeStack:
    """The per-model part of the native decode layers: each layer's weights as ``decode_layer`` arguments and the
    step's buffers, made once; ``build`` returns None for a model it does not take."""

    def __init__(self, plan: list, lib: ctypes.CDLL) -> None:
        first = plan[0]
        self.plan, self.lib = plan, lib
        self.hidden = first.shape[0]
        self.hq, self.hkv, self.d = first.hq, first.hkv, first.d
        inter = first.fast[2].out_features // 2
        self.downs = [lay.fast[3] for lay in plan]
        new = torch.empty  # float32 buffers, reused by every step
        self.residual, self.normed, self.proj = (new(1, self.hidden) for _ in range(3))
        self.qkv = new(1, (self.hq + 2 * self.hkv) * self.d)
        self.qk = new(1, (self.hq + self.hkv) * self.d)
        self.attn_out = new(1, self.hq * self.d)
        self.gate_up, self.act = new(1, 2 * inter), new(1, inter)
        self.gate, self.up = self.gate_up[:, :inter], self.gate_up[:, inter:]
        self.step = _StepArgs(hidden=self.hidden, hq=self.hq, hkv=self.hkv, d=self.d, scale=first.attn.scale,
                              residual=self.residual.data_ptr(), act=self.act.data_ptr(),
                              normed=self.normed.data_ptr(), qkv=self.qkv.data_ptr(), qk=self.qk.data_ptr(),
                              attn=self.attn_out.data_ptr(), proj=self.proj.data_ptr(),
                              gate_up=self.gate_up.data_ptr())
        self._layers_for: tuple | None = None
        self._layers: list = []

    @classmethod
    def build(cls, plan: list) -> NativeStack | None:
        first = plan[0]
        fast = first.fast
        if type(fast[0]) is not NativeWeight:
            return None
        hidden, (hq, hkv, d) = first.shape[0], (first.hq, first.hkv, first.d)
        inter = fast[2].out_features // 2
        for lay in plan:
            f_qkv, f_o, f_gu, f_down = lay.fast
            if not (all(type(f) is NativeWeight and f.lib is fast[0].lib for f in lay.fast)
                    and lay.window is None and (lay.hq, lay.hkv, lay.d) == (hq, hkv, d)
                    and lay.shape == (hidden,) and f_qkv.in_features == hidden
                    and f_qkv.out_features == (hq + 2 * hkv) * d and f_o.in_features == hq * d
                    and f_o.out_features == hidden and f_gu.in_features == hidden
                    and f_gu.out_features == 2 * inter and f_down.in_features == inter
                    and f_down.out_features == hidden and lay.attn.scale == first.attn.scale):
                return None
        return cls(plan, fast[0].lib)

    def _layer_args(self, kv_caches: list[torch.Tensor]) -> list:
        """The layers' ``decode_layer`` arguments, remade when a norm weight or a cache moved or (a new cache in the
        old one's memory) changed size: its V plane then starts elsewhere."""
        key = tuple(p for lay, c in zip(self.plan, kv_caches, strict=True)
                    for p in (lay.w1.data_ptr(), lay.w2.data_ptr(), c.data_ptr(), c.stride(0)))
        if key != self._layers_for:
            layers = []
            for lay, cache in zip(self.plan, kv_caches, strict=True):
                if not (_float32_vector(lay.w1) and _float32_vector(lay.w2)):
                    return []
                f_qkv, f_o, f_gu, f_down = lay.fast
                k_plane = cache.data_ptr()
                layers.append(_LayerArgs(
                    ctypes.addressof(f_qkv._struct), ctypes.addressof(f_o._struct), ctypes.addressof(f_gu._struct),
                    ctypes.addressof(f_down._struct), lay.w1.data_ptr(), lay.w2.data_ptr(), lay.eps1, lay.eps2,
                    k_plane, k_plane + cache.stride(0) * cache.element_size()))
            self._layers, self._layers_for = [ctypes.byref(a) for a in layers], key
        return self._layers

    def run(self, one, hidden: torch.Tensor, residual: torch.Tensor | None, kv_caches: list[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decoder layers over (hidden, residual) of a step with one decoding token (``one``: the lean loop's
        ``_DecodeOne``); None (nothing computed) where this step is not one this path takes."""
        cache = kv_caches[0]
        _, num_blocks, block_size, hkv, d = cache.shape
        blocks = one.blocks
        lo, hi = one.backend._decode_blocks_range
        if (not one.backend.uses_native or hidden.dtype != torch.float32 or hidden.shape != (1, self.hidden)
                or (hkv, d) != (self.hkv, self.d) or any(c.shape != cache.shape for c in kv_caches)
                or not 0 <= lo <= hi < num_blocks or blocks.dtype != torch.int64 or not blocks.is_contiguous()
                or one.seq_len > blocks.numel() * block_size or one.backend._slots_end > num_blocks * block_size
                or one.cos2.numel() != d or not (one.cos2.is_contiguous() and one.sin2.is_contiguous())):
            return None
        layers = self._layer_args(kv_caches)
        if not layers:
            return None
        step = self.step
        step.cos2, step.sin2 = one.cos2.data_ptr(), one.sin2.data_ptr()
        step.slot, step.nkeys = int(one.slots[0]), one.seq_len
        step.blocks, step.block_size, step.nthreads = blocks.data_ptr(), block_size, torch.get_num_threads()
        if residual is None:
            self.residual.copy_(hidden)  # the first layer's residual stream: the embeddings
        else:
            torch.add(hidden, residual, out=self.residual)
        segment, step_ref, prev = self.lib.decode_segment, ctypes.byref(step), None
        for i, lay in enumerate(layers):
            rc = segment(prev, lay, step_ref)
            if rc:
                raise MemoryError(f"native decode layer {i} failed (code {rc})")
            F.silu(self.gate, inplace=True)  # torch's silu, as the lean loop and the modules compute it
            torch.mul(self.gate, self.up, out=self.act)
            prev = lay
        return native_linear(self.act, self.downs[-1]), self.residual.clone()
