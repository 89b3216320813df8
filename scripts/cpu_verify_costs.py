"""What a speculative verify step costs on the CPU's lean path, with its attention over a view of the context
(``rooflm.models.cpu_lean_seq``, "new") against the attention backend's gather and per-layer mask ("old"): one loaded
model (the embedded default, GGUF blocks kept quantized), a decode step and verify steps of 2, 4 and 5 tokens (forward
pass + LM head on every row) after CONTEXT tokens of context, alternated old/new within each round (the order flips
every round) so load that drifts hits both alike; medians over the rounds, at each thread count.

    PYTHONPATH=src python scripts/cpu_verify_costs.py [--context 250] [--rounds 15] [--threads 1 2] [--scattered]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import rooflm.models.cpu_lean as cpu_lean
from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
from rooflm.loader import load_model

BLOCK = 16


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

    new_rule = cpu_lean.seq_step_applies
    paths = {"old": lambda *a: False, "new": new_rule}
    sizes = [1, 2, 4, 5]
    steps = {n: step(n) for n in sizes}
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = {(p, n): [] for p in paths for n in sizes}
        with torch.inference_mode():
            for r in range(args.rounds + 1):
                order = list(paths) if r % 2 == 0 else list(paths)[::-1]
                for n in sizes:
                    for p in order:
                        cpu_lean.seq_step_applies = paths[p]
                        t0 = time.perf_counter()
                        steps[n]()
                        if r:  # the first round warms up
                            times[(p, n)].append(time.perf_counter() - t0)
        cpu_lean.seq_step_applies = new_rule
        load = os.getloadavg()
        print(f"threads {threads}, context {args.context}, {'scattered' if args.scattered else 'consecutive'} "
              f"blocks, {args.rounds} rounds, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        for n in sizes:
            old, new = (statistics.median(times[(p, n)]) * 1e3 for p in paths)
            name = "decode" if n == 1 else f"verify{n}"
            print(f"  {name:8s} old {old:6.1f} ms  new {new:6.1f} ms  new/old {new / old:.3f}")


if __name__ == "__main__":
    main()
