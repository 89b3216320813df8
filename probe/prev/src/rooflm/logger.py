"""rooflm's logger: INFO lines to stderr, configured once."""
from __future__ import annotations

import logging

_configured = False


def get_logger(name: str = "rooflm") -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("rooflm")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s rooflm: %(message)s"))
            root.addHandler(handler)
            root.setLevel(logging.INFO)
            root.propagate = False
        _configured = True
    return logging.getLogger(name)
