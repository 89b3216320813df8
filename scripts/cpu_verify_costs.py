"""What a speculative verify step costs on the CPU's lean path: one loaded model (the embedded default, GGUF blocks
kept quantized), a decode step and verify steps of 2, 4 and 5 tokens (forward pass + LM head on every row) after
CONTEXT tokens of context, each timed through three attention paths alternated within each round (the order turns
every round, so load that drifts hits all alike); medians over the rounds, at each thread count:

- "backend": the attention backend as it is: gather, then each of a verify step's tokens through the decode step's
  own ``scaled_dot_product_attention`` call (``attend_as_decode``, which keeps greedy speculation on the plain path's
  tokens, see ``attention/cpu_backend.py``);
- "fused": the backend with one call of torch's fused kernel for the whole step (what it uses for chunks longer than
  ``EXACT_MAX_QUERY`` tokens);
- "lean": the lean loop's own attention for one sequence (``rooflm.models.cpu_lean_seq``: the context as a view of
  the cache, the mask built once per step).

    PYTHONPATH=src python scripts/cpu_verify_costs.py [--context 250] [--rounds 15] [--threads 1 2] [--scattered]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from rooflm.attention import cpu_backend
from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
from rooflm.loader import load_model
from rooflm.models import cpu_lean

BLOCK = 16


EXACT_MAX_QUERY = cpu_backend.EXACT_MAX_QUERY


def _use(path: str, lean_rule) -> None:
    cpu_backend.EXACT_MAX_QUERY = 0 if path == "fused" else EXACT_MAX_QUERY
    cpu_lean.seq_step_applies = lean_rule if path == "lean" else (lambda *a: False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--scattered", action="store_true", help="the context's blocks in a shuffled order")
    args = parser.parse_args()
    os.environ["ROOFLM_CPU_LEAN"] = "on"
    model, cfg = load_model(None, show_progress=False)
    num_blocks = (args.context + 8 + BLOCK - 1) // BLOCK + 1
    blocks = list(range(num_blocks))
    if args.scattered:
        blocks = blocks[::2] + blocks[1::2]
    caches = allocate_kv_caches(cfg.num_hidden_layers, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    with torch.inference_mode():
        meta, pos = build_attention_metadata([blocks], [0], [args.context], BLOCK)
        model(torch.randint(0, 1000, (args.context,)), pos, caches, meta)

    def step(n: int):
        meta, pos = build_attention_metadata([blocks], [args.context], [n], BLOCK)
        ids = torch.randint(0, 1000, (n,))
        return lambda: model.compute_logits(model(ids, pos, caches, meta))

    lean_rule = cpu_lean.seq_step_applies
    paths = ["backend", "fused", "lean"]
    sizes = [1, 2, 4, 5]
    steps = {n: step(n) for n in sizes}
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {(p, n): [] for p in paths for n in sizes}
        with torch.inference_mode():
            for r in range(args.rounds + 1):
                order = paths[r % 3:] + paths[: r % 3]
                for n in sizes:
                    for p in order:
                        _use(p, lean_rule)
                        t0 = time.perf_counter()
                        steps[n]()
                        if r:  # the first round warms up
                            times[(p, n)].append(time.perf_counter() - t0)
        _use("lean", lean_rule)
        load = os.getloadavg()
        print(f"threads {threads}, context {args.context}, {'scattered' if args.scattered else 'consecutive'} "
              f"blocks, {args.rounds} rounds, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        for n in sizes:
            ms = {p: statistics.median(times[(p, n)]) * 1e3 for p in paths}
            name = "decode" if n == 1 else f"verify{n}"
            print(f"  {name:8s} " + "  ".join(f"{p} {ms[p]:6.1f} ms" for p in paths)
                  + f"  lean/backend {ms['lean'] / ms['backend']:.3f}  lean/fused {ms['lean'] / ms['fused']:.3f}")


if __name__ == "__main__":
    main()
