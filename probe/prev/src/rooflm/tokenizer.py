"""``load_tokenizer``: the transformers tokenizer (with its chat template) of a model, or None for configs without one.

- a HF checkpoint folder: its tokenizer files;
- a ``.gguf`` file (or the default model): rebuilt by transformers from the GGUF metadata (vocab, merges, special
  tokens, ``tokenizer.chat_template``);
- a named config / config.json / a folder without tokenizer files: None (dummy weights have no tokenizer).
"""
from __future__ import annotations

import logging
import os

from rooflm.config import named_configs

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(model: str | None):
    """A ``transformers.PreTrainedTokenizerBase`` for ``model`` (None: the embedded default), or None if it has none."""
    if model is None:
        from rooflm.loader.default_model import default_model_path

        model = default_model_path()
    if model in named_configs() or model.endswith(".json"):
        return None
    if not os.path.exists(model):
        raise FileNotFoundError(f"model={model!r}: no such file or folder, and not a named config")

    from transformers import AutoTokenizer

    if os.path.isdir(model):
        if any(os.path.isfile(os.path.join(model, f)) for f in _TOKENIZER_FILES):
            return AutoTokenizer.from_pretrained(model)
        ggufs = sorted(n for n in os.listdir(model) if n.endswith(".gguf"))
        if len(ggufs) == 1 and not os.path.isfile(os.path.join(model, "config.json")):
            return AutoTokenizer.from_pretrained(model, gguf_file=ggufs[0])
        logger.warning("%s has no tokenizer files: running without a tokenizer (token ids only)", model)
        return None
    if model.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(model))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    raise ValueError(f"model={model!r}: cannot find a tokenizer for it (expected a folder or a .gguf file)")
