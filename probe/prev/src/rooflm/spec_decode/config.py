"""``speculative_config``: which proposer, how many tokens it proposes per step, and its options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "self", "medusa")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: draft tokens verified per step
    # ngram: shortest n-gram matched. 2, not 1: a single repeated token is too often chance (a 1-gram match on
    # unrelated text proposes drafts that are almost never accepted, and costs a verify step).
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4  # ngram: longest n-gram matched (tried first)
    # Switch speculation off for a step when the roofline predicts no gain at the measured acceptance rate.
    auto_disable: bool = True
    # draft_model: the draft's checkpoint (a path, a named config or None for the embedded default model); it must
    # share the target's vocabulary. Loaded with ``load_format`` and the engine's dtype and quantization.
    # medusa: the folder of trained Medusa heads (``rooflm train-medusa``), required.
    model: str | None = None
    load_format: str = "auto"
    # self: the draft is the target's first ``num_draft_layers`` layers, its final norm and its LM head (Draft & Verify,
    # Zhang et al. 2023; LayerSkip, Elhoushi et al. 2024). None: half the layers.
    num_draft_layers: int | None = None
    # medusa: None proposes a chain (each head's top token); a token tree of candidate paths (lists of candidate
    # ranks, e.g. [[0], [1], [0, 0]]) or "default" (Medusa's default tree, cut to 15 nodes) is verified in one
    # forward pass with a tree attention mask (spec_decode/tree.py). Paths deeper than num_speculative_tokens are cut.
    tree: Any = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is not supported: expected one of {METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name}={v!r} is invalid: expected a positive integer")
        n = self.num_draft_layers
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"speculative_config.num_draft_layers={self.num_draft_layers!r} is invalid: expected a "
                             "positive integer or None")
        if self.num_draft_layers is not None and self.method != "self":
            raise ValueError(f"speculative_config.num_draft_layers={self.num_draft_layers} is only for method 'self', "
                             f"not {self.method!r}")
        if self.model is not None and self.method not in ("draft_model", "medusa"):
            raise ValueError(f"speculative_config.model={self.model!r} is only for methods 'draft_model' and "
                             f"'medusa', not {self.method!r}")
        if self.method == "medusa" and self.model is None:
            raise ValueError("speculative_config.model=None is invalid for method 'medusa': expected the folder of "
                             "trained Medusa heads (rooflm train-medusa)")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model={self.model!r} is invalid: expected a path or a name")
        if self.tree is not None:
            if self.method != "medusa":
                raise ValueError(f"speculative_config.tree={self.tree!r} is only for method 'medusa', not "
                                 f"{self.method!r}")
            self.tree_shape()  # validates the paths
        from rooflm.config import LOAD_FORMATS

        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"speculative_config.load_format={self.load_format!r} is invalid: expected one of "
                             f"{LOAD_FORMATS}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} is larger than "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    def tree_shape(self):
        """The token tree (``spec_decode.tree.TreeShape``) cut to num_speculative_tokens levels, or None (a chain)."""
        if self.tree is None:
            return None
        from rooflm.spec_decode.tree import DEFAULT_TREE, TreeShape

        if self.tree == "default":
            choices = DEFAULT_TREE
        elif isinstance(self.tree, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in self.tree):
            choices = self.tree
        else:
            raise ValueError(f"speculative_config.tree={self.tree!r} is invalid: expected \"default\" or a list of "
                             "paths (lists of candidate ranks)")
        shape = TreeShape.from_choices(choices).within_depth(self.num_speculative_tokens)
        return shape

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From a dict, a JSON string (the CLI's ``--speculative-config``) or None (no speculation)."""
        from rooflm.config import parse_json_config

        return parse_json_config(cls, value, "speculative_config")
