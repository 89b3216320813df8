"""How fast do the fused MoE kernels stream Mixtral-8x7B's experts?

One MoE block of Mixtral-8x7B (hidden 4096, intermediate 14336, 8 experts, top-2; random float16 weights) as one rank
of two holds it: ``ep`` (expert parallelism: 4 whole experts) or ``tp`` (tensor parallelism: a 7168-column slice of
all 8). For each step size the routing is random (seeded); the bytes are the weights of the distinct local experts
chosen. ``rooflm.kernels.fused_moe.fused_moe`` is replayed from a CUDA graph over 4 copies of the block (together
several times the L2) and compared with the copy bandwidth measured in the same run; the reference expert loop
(``moe_forward``, which waits on the host) is timed eagerly beside it. ``--sweep`` times other decode tile shapes of
each product at one token.

    PYTHONPATH=src python3 tests/gpu/moe_bench.py [--split ep|tp] [--tokens 1,2,4,32,128,512] [--sweep]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from rooflm.kernels import gemv as G
from rooflm.kernels.activation import silu_and_mul
from rooflm.kernels.fused_moe import MoEGemmConfig, default_config, fused_moe
from rooflm.layers.linear import linear_triton
from rooflm.models.mixtral import moe_forward, route_topk
from rooflm.roofline.measure import measure_bandwidth

H, I, E, TOP_K = 4096, 14336, 8, 2


def blocks(split: str, copies: int, dev) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, int]:
    local, inter = (E // 2, I) if split == "ep" else (E, I // 2)
    out = []
    for _ in range(copies):
        w13 = torch.randn(local, 2 * inter, H, dtype=torch.float16, device=dev) * H ** -0.5
        w2 = torch.randn(local, H, inter, dtype=torch.float16, device=dev) * inter ** -0.5
        out.append((w13, w2))
    return out, local, inter


def expert_bytes(inter: int) -> int:
    return 3 * H * inter * 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", default="ep", choices=["ep", "tp"])
    ap.add_argument("--tokens", default="1,2,4,8,32,128,512")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    copy_gbs = measure_bandwidth("cuda", 2 * 2**30) / 1e9
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s; split {args.split}")
    layers, local, inter = blocks(args.split, 4, dev)
    rows = []
    print(f"{'tokens':>7}{'experts':>8}{'MB':>8}{'fused us':>10}{'GB/s':>7}{'of copy':>8}{'loop us':>10}"
          f"{'speed-up':>9}")
    for t in [int(v) for v in args.tokens.split(",")]:
        g = torch.Generator().manual_seed(t)
        weights, ids = route_topk(torch.randn(t, E, generator=g), TOP_K)
        if t == 1 and args.split == "ep":
            ids = torch.tensor([[0, 1]])  # both experts local: the rank's heavier step
        weights, ids = weights.to(dev), ids.to(dev)
        x = torch.randn(t, H, dtype=torch.float16, device=dev)
        chosen = int(ids[ids < local].unique().numel()) if args.split == "ep" else int(ids.unique().numel())
        nbytes = chosen * expert_bytes(inter)
        ms = G.time_in_graph(lambda w: fused_moe(x, w[0], w[1], weights, ids, 0, E), layers, dev, args.reps)
        loop_ms = float("nan")
        if t in (1, 32):
            def loop():
                for w13, w2 in layers:
                    moe_forward(x, w13, w2, weights, ids, silu_and_mul, linear_triton, 0)
            loop()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                loop()
            torch.cuda.synchronize()
            loop_ms = (time.perf_counter() - t0) * 1e3 / (3 * len(layers))
        gbs = nbytes / ms / 1e6
        rows.append({"tokens": t, "experts": chosen, "bytes": nbytes, "fused_us": ms * 1e3, "gbs": gbs,
                     "of_copy": gbs / copy_gbs, "loop_us": loop_ms * 1e3})
        print(f"{t:>7}{chosen:>8}{nbytes / 1e6:>8.0f}{ms * 1e3:>10.1f}{gbs:>7.0f}{gbs / copy_gbs:>8.1%}"
              f"{loop_ms * 1e3:>10.1f}{loop_ms / ms:>9.1f}")
    if args.sweep:
        weights, ids = route_topk(torch.randn(1, E, generator=torch.Generator().manual_seed(1)), TOP_K)
        ids = torch.tensor([[0, 1]], device=dev)
        weights = weights.to(dev)
        x = torch.randn(1, H, dtype=torch.float16, device=dev)
        d1, d2 = default_config(2, inter, dev), default_config(2, H, dev)
        for which in (1, 2):
            for bn in (16, 32, 64, 128):
                for bk in (64, 128, 256):
                    for stages in (3, 4):
                        for warps in (4,):
                            c = MoEGemmConfig(16, bn, bk, warps, stages)
                            cfgs = (c, d2) if which == 1 else (d1, c)
                            try:
                                ms = G.time_in_graph(lambda w: fused_moe(x, w[0], w[1], weights, ids, 0, E,
                                                                         configs=cfgs), layers, dev, 5)
                            except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                                print(f"product {which} {c}: {type(e).__name__}")
                                continue
                            print(f"product {which} bn {bn:>3} bk {bk:>3} stages {stages} warps {warps}: "
                                  f"{ms * 1e3:.1f} us ({2 * expert_bytes(inter) / ms / 1e6:.0f} GB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "split": args.split,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
