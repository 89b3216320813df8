"""Where a Medusa step's time goes on this machine: interleaved timings on one loaded model (the embedded default)
of a decode step, verify steps of n tokens and of the default token tree (forward pass + LM head on every row, 250
tokens of context), a Medusa draft (the heads + the LM head on their k rows) and verify steps of k + 1 tokens with
the k heads of every row in the same LM head product (``vN+hK``: what a chain step costs on the CPU's fused path,
drafts included); medians of 6 runs, so load that drifts during the run hits every kind of step alike.

    PYTHONPATH=src python scripts/medusa_step_costs.py HEADS_DIR
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
from rooflm.loader import load_model
from rooflm.spec_decode.medusa import load_medusa_heads
from rooflm.spec_decode.tree import DEFAULT_TREE, TreeShape, attention_mask

CONTEXT = 250


def main(heads_dir: str) -> None:
    model, cfg = load_model(None, dtype=torch.float32, device="cpu", show_progress=False)
    heads, _ = load_medusa_heads(heads_dir, cfg)
    caches = allocate_kv_caches(cfg.num_hidden_layers, 32, 16, cfg.num_key_value_heads, cfg.head_dim)
    blocks = list(range(32))
    with torch.inference_mode():
        meta, pos = build_attention_metadata([blocks], [0], [CONTEXT], 16, "cpu")
        model(torch.randint(0, 1000, (CONTEXT,)), pos, caches, meta)

    def forward(n: int, tree: TreeShape | None = None):
        meta, pos = build_attention_metadata([blocks], [CONTEXT], [n], 16, "cpu")
        if tree is not None:
            meta.tree_masks = [attention_mask(tree.parents)]
        ids = torch.randint(0, 1000, (n,))
        return lambda: model.compute_logits(model(ids, pos, caches, meta))

    def draft(k: int):
        h = torch.randn(1, cfg.hidden_size)
        return lambda: model.compute_logits(heads(h, k).reshape(-1, cfg.hidden_size))

    def verify_with_heads(n: int, k: int):
        """A verify step of n tokens whose k heads per row ride in its LM head product (the CPU's fused path)."""
        meta, pos = build_attention_metadata([blocks], [CONTEXT], [n], 16, "cpu")
        ids = torch.randint(0, 1000, (n,))

        def step():
            h = model(ids, pos, caches, meta)
            return model.compute_logits(torch.cat((h, heads(h, k).reshape(-1, cfg.hidden_size))))
        return step

    tree = TreeShape.from_choices(DEFAULT_TREE)
    cases = {"decode": forward(1), "verify2": forward(2), "verify4": forward(4), "verify5": forward(5),
             f"tree{tree.num_nodes + 1}": forward(tree.num_nodes + 1, tree), "draft1": draft(1), "draft3": draft(3),
             "draft4": draft(4), "v2+h1": verify_with_heads(2, 1), "v3+h2": verify_with_heads(3, 2),
             "v4+h3": verify_with_heads(4, 3)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for _ in range(7):
            for name, step in cases.items():
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first round warms up
    for name, t in medians.items():
        print(f"{name:8s} {t * 1e3:8.1f} ms  {t / medians['decode']:.2f}x a decode step")


if __name__ == "__main__":
    main(sys.argv[1])
