"""Tile sweep of the one-row word GEMV (``rooflm/kernels/quant_gemv.py``) on the running GPU, 4- and 8-bit.

For Llama-2-7B's projections at one row, W4A16 (group 128, with mins) and W8A16 (per channel): the time of the
kernel ``quant_linear`` runs today (the word GEMV at 4 bits, the general kernel at 8) and of a grid of word-GEMV
configurations (rows a program, words a tile, K splits, warps, with and without the next tile's words loaded before
the current tile's products), each replayed from a CUDA graph over weight copies that together exceed the L2
(``gemv.time_in_graph``). Prints the default and the fastest configurations per shape, in GB/s of the packed weight
and as a fraction of a read-only stream of 2 GiB measured in the same run.

    PYTHONPATH=src python3 tests/gpu/quant_gemv_sweep.py [--formats w4g128,w8] [--shapes qkv,o,gate_up,down,lm_head]
        [--asm on|off|both] [--pair on|off|both] [--grid full|candidates|depths] [--depths 0,1,2]
        [--l2-ahead 0,4]

``--grid depths`` times each candidate ``pick_gemv`` times with its tiles loaded 0, 1 and 2 tiles ahead
(``QuantGemvConfig.prefetch``, ``--depths``), each also with the L2 asked for the tile ``--l2-ahead`` ahead
(``QuantGemvConfig.l2_ahead``; 0: not asked), and reports the fastest at each depth and each L2 distance.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import replace

import torch


def read_stream_gbps() -> float:
    """GB/s of one large read (a sum over 2 GiB of float16), the ceiling a weight stream can reach."""
    x = torch.ones(2**30, dtype=torch.float16, device="cuda")
    x.sum()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        x.sum()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return x.numel() * 2 / min(times) / 1e6


def grid(n: int, k: int, bits: int, sms: int, asm: tuple[bool, ...] = (True,), pair: tuple[bool, ...] = (False,)):
    from rooflm.kernels.quant_gemv import QuantGemvConfig

    splits = (1, 2, 4) if -(-n // 16) < 2 * sms else (1,)
    for bn, words, split, warps, pre, a, pr in itertools.product((8, 16, 32, 64), (64, 128), splits, (2, 4, 8),
                                                                 (False, True), asm, pair):
        if bn * words // (32 * warps) < 1 or (pr and not a):
            continue
        yield QuantGemvConfig(bn, words, split, warps, 3, prefetch=pre, asm=a, pair=pr)


def main(argv=None) -> int:
    from rooflm.kernels._utils import device_sms
    from rooflm.kernels.bench_quant import SHAPES
    from rooflm.kernels.gemv import time_in_graph
    from rooflm.kernels.quant_gemm import launch, pick_config
    from rooflm.kernels.quant_gemv import (default_gemv_config, gemv_candidates, launch_gemv, packed_copies, supports,
                                           tile_groups)
    from rooflm.quantization.rtn import quantize_rtn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="w4g128,w8")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--grid", choices=("full", "candidates", "depths"), default="full",
                   help="the whole grid, only the configurations pick_gemv times (gemv_candidates), or those at "
                        "each prefetch depth (0, 1, 2 tiles ahead)")
    p.add_argument("--depths", default="0,1,2", help="with --grid depths: tiles loaded ahead into registers")
    p.add_argument("--l2-ahead", default="0", help="with --grid depths: tiles ahead the L2 is asked for (0: none)")
    p.add_argument("--asm", choices=("on", "off", "both"), default="on",
                   help="products in float16x2 PTX (on), in the float32 form (off), or each configuration both ways")
    p.add_argument("--pair", choices=("on", "off", "both"), default="off",
                   help="with the PTX products: two words summed before one conversion (on), one word (off), or both")
    args = p.parse_args(argv)
    formats = {"w4g128": (4, 128), "w8": (8, None)}
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    stream = read_stream_gbps()
    print(json.dumps({"device": props.name, "sms": props.multi_processor_count, "read_stream_gbps": round(stream)}),
          flush=True)
    out = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, dtype=torch.float16, device=dev) / math.sqrt(k)
        for fmt in args.formats.split(","):
            bits, group = formats[fmt]
            pw = quantize_rtn(w, bits, group)
            copies = packed_copies(pw)
            x = torch.randn(1, k, dtype=torch.float16, device=dev)
            ref = launch(x, pw, None, pick_config(x, pw, None)).float()
            if supports(x, pw):
                cfg0 = default_gemv_config(n, k, bits, pw.group_size, device_sms(x))
                t0 = time_in_graph(lambda q: launch_gemv(x, q, None), copies, dev)
                what0 = f"word GEMV {cfg0}"
            else:
                c = pick_config(x, pw, None)
                t0 = time_in_graph(lambda q: launch(x, q, None, c), copies, dev)
                what0 = f"general kernel {c}"
            res = []
            asm = {"on": (True,), "off": (False,), "both": (True, False)}[args.asm]
            pair = {"on": (True,), "off": (False,), "both": (True, False)}[args.pair]
            if args.grid == "full":
                cfgs = list(grid(n, k, bits, props.multi_processor_count, asm, pair))
            else:
                cfgs = [replace(c, asm=a, pair=pr) for c in gemv_candidates(n, k, bits, pw.group_size, device_sms(x))
                        if c is not None for a in asm for pr in pair if a or not pr]
                if args.grid == "depths":
                    depths = [int(d) for d in args.depths.split(",")]
                    l2s = [int(a) for a in args.l2_ahead.split(",")]
                    cfgs = list(dict.fromkeys(replace(c, prefetch=d, l2_ahead=a) for c in cfgs for d in depths
                                              for a in l2s if a == 0 or a > d))
            for cfg in cfgs:
                if tile_groups(cfg.words, k, bits, pw.group_size) is None:
                    continue
                try:
                    got = launch_gemv(x, pw, None, cfg).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    t = time_in_graph(lambda q, c=cfg: launch_gemv(x, q, None, c), copies, dev)
                except Exception as e:  # noqa: BLE001 - report, go on
                    print(f"{name} {fmt} {cfg}: {type(e).__name__} {str(e)[:160]}", flush=True)
                    continue
                res.append((t, cfg, err))
            res.sort(key=lambda r: r[0])

            def gb(t):
                return pw.nbytes / t / 1e6

            row = {"shape": name, "format": fmt, "bytes": pw.nbytes, "default": what0, "default_us": round(t0 * 1e3, 2),
                   "default_frac": round(gb(t0) / stream, 3),
                   "best": [{"cfg": str(c), "us": round(t * 1e3, 2), "frac": round(gb(t) / stream, 3),
                             "rel_err": float(f"{e:.1e}")} for t, c, e in res[: args.top]],
                   "best_no_prefetch": next(({"cfg": str(c), "us": round(t * 1e3, 2)} for t, c, _ in res
                                             if not c.prefetch), None),
                   "best_by_depth": {d: next(({"cfg": str(c), "us": round(t * 1e3, 2)} for t, c, _ in res
                                              if int(c.prefetch) == d), None) for d in (0, 1, 2)},
                   "best_by_l2_ahead": {a: next(({"cfg": str(c), "us": round(t * 1e3, 2)} for t, c, _ in res
                                                 if c.l2_ahead == a), None)
                                        for a in sorted({c.l2_ahead for c in cfgs})},
                   "best_float32_form": next(({"cfg": str(c), "us": round(t * 1e3, 2)} for t, c, _ in res
                                              if not c.asm), None),
                   "best_one_word": next(({"cfg": str(c), "us": round(t * 1e3, 2)} for t, c, _ in res
                                          if c.asm and not c.pair), None)}
            out.append(row)
            print(json.dumps(row), flush=True)
            del copies
        del w
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read_stream_gbps": stream, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
