"""Reading and writing GPTQ and AWQ checkpoints in the Hugging Face folder layout (config.json with a
``quantization_config``, safetensors weights, tokenizer files), as ``transformers`` and vLLM publish and load them.

A quantized module ``m`` is stored as ``m.qweight``, ``m.qzeros``, ``m.scales`` and, for GPTQ, ``m.g_idx``
(layouts in ``rooflm.quantization.formats``); every other tensor (embeddings, norms, biases, the LM head) is stored
as it is.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from rooflm.quantization.formats import (
    GPTQ_CHECKPOINT_FORMATS, IntQuant, awq_to_packed, from_packed, gptq_to_packed, to_awq, to_gptq,
)
from rooflm.quantization.packed import PackedWeight

logger = logging.getLogger(__name__)

QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class QuantFormat:
    """The fields of a checkpoint's ``quantization_config`` that decide how its tensors are laid out."""

    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # -1: one group per output channel
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # GPTQ only: "gptq" (zeros stored minus one) | "gptq_v2"

    @classmethod
    def from_config(cls, cfg: Mapping) -> QuantFormat:
        """Parse and check a ``quantization_config`` dict; ValueError naming the field for what is not supported."""
        method = str(cfg.get("quant_method", "")).lower()
        if method not in ("gptq", "awq"):
            raise ValueError(f"quantization_config.quant_method={cfg.get('quant_method')!r} is not supported: "
                             "expected 'gptq' or 'awq'")
        bits = cfg.get("bits", cfg.get("w_bit"))
        allowed = (4, 8) if method == "gptq" else (4,)
        if bits not in allowed:
            raise ValueError(f"quantization_config.bits={bits!r} is not supported for {method}: expected one of "
                             f"{allowed}")
        group_size = cfg.get("group_size", cfg.get("q_group_size", -1))
        if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
            raise ValueError(f"quantization_config.group_size={group_size!r} is invalid: expected a positive "
                             "integer or -1")
        if method == "awq":
            version = str(cfg.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"quantization_config.version={cfg.get('version')!r} is not supported: only AWQ "
                                 "'gemm' checkpoints can be read")
            if cfg.get("zero_point", True) is False:
                raise ValueError("quantization_config.zero_point=False is not supported: AWQ GEMM checkpoints "
                                 "store zero points")
            return cls("awq", bits, group_size)
        fmt = cfg.get("checkpoint_format") or cfg.get("format") or "gptq"
        if cfg.get("is_marlin_format"):
            fmt = "marlin"
        if fmt not in GPTQ_CHECKPOINT_FORMATS:
            raise ValueError(f"quantization_config.checkpoint_format={fmt!r} is not supported: expected one of "
                             f"{GPTQ_CHECKPOINT_FORMATS}")
        return cls("gptq", bits, group_size, bool(cfg.get("desc_act", False)), fmt)

    def to_packed(self, module: str, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> PackedWeight:
        """The ``PackedWeight`` of one module's tensors; ValueError naming the tensor when one is missing, has the
        wrong dtype or the wrong shape."""
        need = ("qweight", "qzeros", "scales")
        for p in need:
            if p not in parts:
                raise ValueError(f"{self.method} checkpoint: tensor {module}.{p} is missing (the module has "
                                 f"{', '.join(sorted(f'{module}.{k}' for k in parts))})")
        for p in ("qweight", "qzeros"):
            if parts[p].dtype != torch.int32:
                raise ValueError(f"{self.method} checkpoint: {module}.{p} has dtype {parts[p].dtype}, expected "
                                 "torch.int32")
        try:
            if self.method == "awq":
                return awq_to_packed(parts["qweight"], parts["qzeros"], parts["scales"], self.bits, self.group_size,
                                     dtype)
            return gptq_to_packed(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), self.bits,
                                  self.group_size, dtype, self.checkpoint_format)
        except ValueError as e:
            raise ValueError(f"{self.method} checkpoint, module {module}: {e}") from None


def _split(name: str) -> tuple[str, str | None]:
    """``model.layers.0.mlp.up_proj.qweight`` -> (``model.layers.0.mlp.up_proj``, ``qweight``)."""
    module, _, leaf = name.rpartition(".")
    return (module, leaf) if leaf in QUANT_SUFFIXES else (name, None)


def iter_quantized_safetensors(files: list[str], quant_cfg: Mapping,
                               dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """(HF name, tensor) for the plain tensors of a GPTQ / AWQ checkpoint and (``f"{module}.weight"``,
    ``PackedWeight``) for each quantized module, its scales and mins in ``dtype``. A module's tensors may sit in
    different shards: the module is yielded once all of them have been read. ValueError naming the tensor or the
    ``quantization_config`` field when the checkpoint does not match its declared format."""
    from safetensors import safe_open

    from rooflm.loader.safetensors import _open, iter_safetensors

    fmt = QuantFormat.from_config(quant_cfg)
    expected: dict[str, set[str]] = {}  # module -> the parts the files hold
    for path in files:
        with _open(path, safe_open) as f:
            for name in f.keys():
                module, leaf = _split(name)
                if leaf is not None:
                    expected.setdefault(module, set()).add(leaf)
    for module, parts in expected.items():
        if "qweight" not in parts:
            raise ValueError(f"{fmt.method} checkpoint: tensor {module}.qweight is missing (found "
                             f"{', '.join(sorted(f'{module}.{p}' for p in parts))})")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_safetensors(files):
        module, leaf = _split(name)
        if leaf is None:
            yield name, tensor
            continue
        got = pending.setdefault(module, {})
        got[leaf] = tensor
        if set(got) == expected[module]:
            del pending[module]
            yield f"{module}.weight", fmt.to_packed(module, got, dtype)


def quantization_config(method: str, bits: int, group_size: int, desc_act: bool = False,
                        checkpoint_format: str = "gptq", fmt: str | None = None, percdamp: float = 0.01,
                        sym: bool = False) -> dict:
    """The ``quantization_config`` entry of config.json, with the fields published checkpoints carry. ``method``:
    the algorithm (rtn | gptq | awq); ``fmt``: the layout written (default: awq for AWQ, else gptq)."""
    fmt = fmt or ("awq" if method == "awq" else "gptq")
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "damp_percent": percdamp, "static_groups": False, "true_sequential": False,
            "checkpoint_format": checkpoint_format, "lm_head": False,
            "meta": {"quantizer": ["rooflm"], "algorithm": method}}


def save_quantized_checkpoint(out_dir: str, float_state: Mapping[str, torch.Tensor],
                              quantized: Mapping[str, IntQuant | PackedWeight], hf_config: Mapping, method: str,
                              bits: int, group_size: int, desc_act: bool = False, fmt: str | None = None,
                              checkpoint_format: str = "gptq", tokenizer_source: str | None = None,
                              float_dtype: torch.dtype = torch.float16) -> str:
    """Write a checkpoint folder: config.json (``hf_config`` plus ``quantization_config``), model.safetensors
    (quantized modules as ``qweight``/``qzeros``/``scales``[/``g_idx``], other tensors cast to ``float_dtype``) and
    the tokenizer files of ``tokenizer_source`` (a HF folder: copied; a GGUF file: the tokenizer transformers builds
    from it, saved). Returns the path of the weights file."""
    from safetensors.torch import save_file

    fmt = fmt or ("awq" if method == "awq" else "gptq")
    if fmt not in ("gptq", "awq"):
        raise ValueError(f"format={fmt!r} is invalid: expected 'gptq' or 'awq'")
    if fmt == "awq" and (bits != 4 or desc_act):
        raise ValueError(f"the AWQ format holds 4-bit weights without act-order: got bits={bits}, desc_act={desc_act}")
    os.makedirs(out_dir, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in float_state.items():
        tensors[name] = t.detach().to("cpu", float_dtype if t.is_floating_point() else t.dtype).contiguous()
    for module, q in quantized.items():
        iq = from_packed(q) if isinstance(q, PackedWeight) else q
        parts = to_awq(iq) if fmt == "awq" else to_gptq(iq, checkpoint_format)
        for leaf, t in parts.items():
            tensors[f"{module}.{leaf}"] = t.to("cpu").contiguous()
    path = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})

    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    config["torch_dtype"] = str(float_dtype).removeprefix("torch.")
    config["quantization_config"] = quantization_config(method, bits, group_size, desc_act, checkpoint_format, fmt)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if tokenizer_source:
        _copy_tokenizer(tokenizer_source, out_dir)
    return path


def _copy_tokenizer(source: str, out_dir: str) -> None:
    if os.path.isdir(source):
        for name in TOKENIZER_FILES:
            src = os.path.join(source, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, name))
        return
    if source.endswith(".gguf"):
        from rooflm.tokenizer import load_tokenizer

        tok = load_tokenizer(source)
        if tok is not None:
            tok.save_pretrained(out_dir)
