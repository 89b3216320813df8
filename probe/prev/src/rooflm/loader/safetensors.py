"""Hugging Face checkpoint folders: config.json + one ``*.safetensors`` file or shards listed in
``model.safetensors.index.json``. Tensors are streamed one at a time (never the whole checkpoint in memory)."""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: str) -> list[str]:
    """The weight files of a checkpoint folder, in a stable order. FileNotFoundError if there are none or a shard
    named by the index is missing."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"weight shard {path} listed in {INDEX_FILE} does not exist")
        return files
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        other = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth")))
        hint = f" (found {', '.join(other[:3])}: only safetensors checkpoints are supported)" if other else ""
        raise FileNotFoundError(
            f"no *.safetensors weight file in {folder}{hint}; use load_format='dummy' for random weights from its "
            "config"
        )
    return files


def count_tensors(files: list[str]) -> int:
    from safetensors import safe_open

    n = 0
    for path in files:
        with _open(path, safe_open) as f:
            n += len(list(f.keys()))
    return n


def iter_safetensors(files: list[str], skip: Callable[[str], bool] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor of every file, except those ``skip`` is true for, which are never read
    (another pipeline stage's layers, another expert-parallel rank's experts). A corrupt or truncated file raises
    ValueError naming it."""
    from safetensors import safe_open

    for path in files:
        with _open(path, safe_open) as f:
            for name in f.keys():
                if skip is not None and skip(name):
                    continue
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:  # truncated data region
                    raise ValueError(f"{path}: corrupt or truncated safetensors file (tensor {name!r}: {e})") from None
                yield name, tensor


class _open:
    """``safe_open`` with a clear error for a file that is not a valid safetensors file."""

    def __init__(self, path: str, safe_open) -> None:
        self.path = path
        try:
            self.handle = safe_open(path, framework="pt", device="cpu")
        except FileNotFoundError:
            raise FileNotFoundError(f"weight file {path} does not exist") from None
        except Exception as e:
            raise ValueError(f"{path}: corrupt or truncated safetensors file ({e})") from None

    def __enter__(self):
        return self.handle

    def __exit__(self, *exc) -> None:
        self.handle = None
