"""GGUF files (llama.cpp / Ollama): architecture from the metadata, tensors dequantized with the ``gguf`` package
or, with ``iter_gguf_tensors(..., keep_quantized=True)``, kept in their block format as ``PackedWeight``s
(``quantization.gguf_repack``).

Two conversions undo what llama.cpp's converter did:
- names: ``blk.{i}.attn_q.weight`` -> ``model.layers.{i}.self_attn.q_proj.weight`` etc. (HF names, so the models'
  ``load_weights`` serves both formats);
- for the ``llama`` architecture the q/k projection rows are permuted for llama.cpp's interleaved rotary layout
  (pairs (2i, 2i+1) instead of HF's halves (i, i + head_dim/2)); ``unpermute_qk`` (``unpermute_qk_packed`` for a
  packed weight) restores HF's order.
Shapes: GGUF lists dimensions fastest-first (ne0 = columns), so a tensor's torch shape is the reverse.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from rooflm.config import ModelConfig
from rooflm.quantization.gguf_repack import UnsupportedGGUFType, gguf_to_packed
from rooflm.quantization.packed import PackedWeight

logger = logging.getLogger(__name__)

# llama.cpp's end-of-generation tokens: stopping on them is what llama.cpp and Ollama do, whatever eos_token_id says.
EOG_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>", "<end_of_turn>", "</s>")
CONTROL_TOKEN_TYPE = 3

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_EXPERT_NAMES = {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"}  # stacked [E, out, in]
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str):
    """A ``gguf.GGUFReader``; FileNotFoundError / ValueError (corrupt or truncated) naming the file."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def _meta(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_architecture(arch: str, name: str, num_experts: int) -> tuple[str, str]:
    """(architectures[0], model_type) for a GGUF ``general.architecture`` (llama.cpp files Mistral/Mixtral as llama)."""
    if arch == "llama":
        if num_experts > 0:
            return "MixtralForCausalLM", "mixtral"
        if "mistral" in name.lower():
            return "MistralForCausalLM", "mistral"
        return "LlamaForCausalLM", "llama"
    if arch == "qwen2":
        return "Qwen2ForCausalLM", "qwen2"
    return f"gguf:{arch}", arch  # unsupported: the model registry lists what is


def read_gguf_config(path: str) -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata (and tensor list for tied embeddings / bias / rope factors)."""
    reader = open_gguf(path)
    arch = _meta(reader, "general.architecture")
    if arch is None:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")

    def a(key: str, default: Any = None) -> Any:
        return _meta(reader, f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    tokens = _meta(reader, "tokenizer.ggml.tokens") or []
    hidden = a("embedding_length")
    heads = a("attention.head_count")
    if hidden is None or heads is None or a("block_count") is None:
        raise ValueError(f"{path}: GGUF architecture {arch!r} lacks {arch}.embedding_length/head_count/block_count")
    num_experts = a("expert_count", 0) or 0
    architecture, model_type = _hf_architecture(arch, _meta(reader, "general.name", "") or "", num_experts)
    kv_heads = a("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # some architectures store one count per layer
        kv_heads = max(kv_heads)

    rope_scaling = None
    if a("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    if "rope_freqs.weight" in tensor_names:  # Llama 3.1+: llama.cpp stores the per-frequency divisors as a tensor
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        rope_scaling = {"rope_type": "freq_factors", "factors": dequantize_tensor(t).flatten().tolist()}

    eos = _meta(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [] if eos is None else [int(eos)]
    token_types = _meta(reader, "tokenizer.ggml.token_type") or []
    for i, tok in enumerate(tokens):
        if tok in EOG_TOKENS and i not in eos_ids and (not token_types or token_types[i] == CONTROL_TOKEN_TYPE):
            eos_ids.append(i)

    d: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": a("vocab_size") or len(tokens) or _embedding_rows(reader),
        "hidden_size": hidden,
        "intermediate_size": a("expert_feed_forward_length") or a("feed_forward_length"),
        "num_hidden_layers": a("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": a("attention.key_length") or hidden // heads,
        "max_position_embeddings": a("context_length", 4096),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "sliding_window": a("attention.sliding_window"),
        "num_local_experts": num_experts,
        "num_experts_per_tok": a("expert_used_count", 0) or 0,
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids,
        "_source": path,
        "_gguf_architecture": arch,
    }
    return ModelConfig.from_hf_dict(d, name=path)


def _embedding_rows(reader) -> int:
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(t.shape[-1])


def _torch_shape(t) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def dequantize_tensor(t) -> torch.Tensor:
    """One GGUF tensor as float32 torch, in torch dimension order (reverse of GGUF's)."""
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be dequantized") from None
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(_torch_shape(t))
    if not arr.flags.writeable:  # a view of the read-only memory map (F32)
        arr = arr.copy()
    return torch.from_numpy(arr)


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. w: [num_heads * head_dim, ...] (weight or bias). Within each head
    llama.cpp stores row (2i + j) what HF stores at row (j * head_dim/2 + i); this maps back."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_to_hf_name(name: str) -> str | None:
    """HF name of a (non-expert) GGUF tensor; None for tensors without an HF counterpart."""
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def count_gguf_tensors(reader) -> int:
    return len(reader.tensors)


def unpermute_qk_packed(pw: PackedWeight, num_heads: int) -> PackedWeight:
    """``unpermute_qk`` for a packed weight: codes, scales and mins are all stored row by row, so permuting the
    rows of each is exact (the column permutation ``perm`` is untouched)."""
    mins = None if pw.mins is None else unpermute_qk(pw.mins, num_heads)
    return replace(pw, qweight=unpermute_qk(pw.qweight, num_heads), scales=unpermute_qk(pw.scales, num_heads),
                   mins=mins)


def iter_gguf_tensors(reader, cfg: ModelConfig, keep_quantized: bool = False,
                      dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """(HF name, weight) for every weight of the file, renamed and with llama's q/k rows un-permuted.

    By default every weight is a float32 CPU tensor (dequantized). With ``keep_quantized`` each 2-D tensor in a
    block format that repacks exactly (``gguf_repack.REPACKABLE_TYPES``) is yielded as a ``PackedWeight`` with
    ``dtype`` scales, a stacked expert tensor as one PackedWeight per expert; other types are dequantized (logged
    once per type). ``token_embd.weight`` is always float (an embedding lookup gathers rows); when the file ties the
    LM head to it (no ``output.weight``), it is also yielded packed as ``lm_head.weight``, so the head's matmul
    reads the file's quantized bytes."""
    arch = _meta(reader, "general.architecture")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    unsupported_logged: set[str] = set()

    def packed(t, data: np.ndarray, shape: tuple[int, ...]) -> PackedWeight | None:
        if not keep_quantized or len(shape) != 2:
            return None
        try:
            return gguf_to_packed(data, t.tensor_type, shape, dtype)
        except UnsupportedGGUFType:
            if t.tensor_type.name not in unsupported_logged:
                unsupported_logged.add(t.tensor_type.name)
                logger.warning("GGUF type %s has no packed int4/int8 form: dequantizing its tensors (first: %s)",
                               t.tensor_type.name, t.name)
            return None

    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # folded into the config's rope_scaling
            continue
        m = _BLOCK_RE.match(t.name)
        if m and m.group(2) in _EXPERT_NAMES:  # stacked experts [E, out, in] -> one HF tensor per expert
            prefix = f"model.layers.{m.group(1)}.block_sparse_moe.experts"
            suffix = f"{_EXPERT_NAMES[m.group(2)]}.weight"
            shape = _torch_shape(t)
            first = packed(t, t.data[0], shape[1:]) if len(shape) == 3 else None
            if first is not None:
                yield f"{prefix}.0.{suffix}", first
                for e in range(1, shape[0]):
                    yield f"{prefix}.{e}.{suffix}", gguf_to_packed(t.data[e], t.tensor_type, shape[1:], dtype)
                continue
            w = dequantize_tensor(t)
            for e in range(w.shape[0]):
                yield f"{prefix}.{e}.{suffix}", w[e]
            continue
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            logger.warning("ignoring GGUF tensor %s: no rooflm counterpart", t.name)
            continue
        if t.name == "token_embd.weight":
            yield hf, dequantize_tensor(t)
            head = packed(t, t.data, _torch_shape(t)) if tied else None
            if head is not None:
                yield "lm_head.weight", head
            continue
        pw = packed(t, t.data, _torch_shape(t))
        w = dequantize_tensor(t) if pw is None else pw
        heads = None
        if arch == "llama" and m and m.group(2) == "attn_q":
            heads = cfg.num_attention_heads
        elif arch == "llama" and m and m.group(2) == "attn_k":
            heads = cfg.num_key_value_heads
        if heads is not None:
            w = unpermute_qk(w, heads) if pw is None else unpermute_qk_packed(pw, heads)
        yield hf, w


def gguf_weight_bytes(path: str, streamed_only: bool = False) -> int:
    """Bytes of the file's weight tensors as stored (quantized blocks, not dequantized floats): the weight traffic
    of the roofline. ``streamed_only`` leaves out ``token_embd.weight`` when the file has a separate LM head
    (``output.weight``): decoding then gathers a few embedding rows per token instead of reading the matrix."""
    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    skip = {"rope_freqs.weight"}  # not a weight: folded into the rotary frequencies
    if streamed_only and "output.weight" in names:
        skip.add("token_embd.weight")
    return sum(int(t.n_bytes) for t in reader.tensors if t.name not in skip)
