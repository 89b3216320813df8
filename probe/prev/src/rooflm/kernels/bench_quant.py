"""Weight-only quantized matmul against fp16 on the running GPU:
``python -m rooflm.kernels.bench_quant [--ms 1,16,64] [--sweep] [--tune] [--json FILE]``.

For Llama-2-7B's five projection shapes and each row count M: ``quant_linear``'s choice of kernel on W4A16 (group 128, with mins, the
GPTQ / AWQ form) and W8A16 (per channel, symmetric), and ``torch.nn.functional.linear`` on the fp16 weight, each
replayed from a CUDA graph over weight copies that together exceed the L2 (``gemv.time_in_graph``), so the weight
comes from device memory as in a real decode step. Reported per row: microseconds per call, GB/s of the packed weight
(``PackedWeight.nbytes``: codes, scales, mins) and that as a fraction of the device-to-device copy bandwidth measured
in the same process (bytes read + written), and the speed-up over fp16. ``--sweep`` also times a grid of block
configurations and prints the fastest ones (for tuning ``quant_gemm.default_config``).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import torch

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
          "lm_head": (32000, 4096)}
FORMATS = {"w4g128": (4, 128), "w8": (8, None), "w4g32": (4, 32)}


def sweep_configs(m: int, bits: int) -> list:
    """Block configurations ``--sweep`` times (x_split varies only at 4 bits, where it matters)."""
    from rooflm.kernels.quant_gemm import QuantMMConfig

    xs = (0, 1, 2) if bits == 4 else (1,)
    if m == 1:
        grid = [(1, bn, bk, s, 4, 3) for bn in (16, 32) for bk in (128, 256) for s in (1, 2)]
        grid += [(1, bn, 512, 1, w, 3) for bn in (8, 16) for w in (2, 4)]
    elif m <= 16:
        grid = [(16, bn, bk, s, 4, 4) for bn in (32, 64) for bk in (64, 128) for s in (1, 2, 4)]
    else:
        grid = [(64, 128, 64, s, 4, 3) for s in (1, 2)] + [(64, 64, 64, s, 4, 3) for s in (1, 2)]
        grid += [(64, 128, 128, 1, 8, 3), (128, 128, 64, 1, 8, 3), (64, 256, 64, 1, 8, 3)]
    asms = (0, 1, 2) if bits == 4 else (0,)  # the PTX conversions of 4-bit codes
    return [QuantMMConfig(*g, x_split=x, asm=a) for g in grid for x in xs for a in asms]


def bench(ms=(1, 16, 64), sweep: bool = False, sweep_shapes=("qkv", "down"),
          dtype=torch.float16, formats=tuple(FORMATS)) -> tuple[dict, list[dict]]:
    from rooflm.kernels.gemv import time_in_graph, weight_copies
    from rooflm.kernels.quant_gemm import launch, pick_config
    from rooflm.kernels.quant_gemv import launch_gemv, packed_copies
    from rooflm.kernels.quant_gemv import supports as gemv_supports
    from rooflm.quantization.rtn import quantize_rtn
    from rooflm.roofline.measure import measure_bandwidth

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = int(getattr(props, "L2_cache_size", 0) or 64 * 2**20)
    copy_gbps = measure_bandwidth("cuda", nbytes=2**30, reps=20) / 1e9
    head = {"device": props.name, "sms": props.multi_processor_count, "l2_mb": l2 / 2**20, "copy_gbps": copy_gbps}
    print(json.dumps(head), flush=True)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=dtype, device=dev) / math.sqrt(k)
        fp16_copies = weight_copies(w)
        packed = {f: quantize_rtn(w, bits, g) for f, (bits, g) in FORMATS.items() if f in formats}
        for m in ms:
            x = torch.randn(m, k, dtype=dtype, device=dev)
            t16 = time_in_graph(lambda ww: torch.nn.functional.linear(x, ww), fp16_copies, dev)
            for fmt, pw in packed.items():
                copies = packed_copies(pw)
                cfg = pick_config(x, pw, None)
                word = gemv_supports(x, pw)  # quant_linear's choice: the word GEMV for one row of 4-bit codes
                if word:
                    t = time_in_graph(lambda p: launch_gemv(x, p, None), copies, dev)
                else:
                    t = time_in_graph(lambda p, c=cfg: launch(x, p, None, c), copies, dev)
                gbps = pw.nbytes / t / 1e6
                row = {"shape": name, "n": n, "k": k, "m": m, "format": fmt, "us": round(t * 1e3, 2),
                       "gbps": round(gbps, 1), "frac_copy_bw": round(gbps / copy_gbps, 3),
                       "fp16_us": round(t16 * 1e3, 2), "speedup_vs_fp16": round(t16 / t, 2),
                       "tflops": round(2 * m * n * k / t / 1e9, 1), "config": "word GEMV" if word else _short(cfg)}
                if pw.bits == 4:  # the general kernel's three conversions of 4-bit codes, same tiles
                    ref = launch(x, pw, None, replace(cfg, asm=0)).float()
                    row["asm_us"], row["asm_max_rel_err"] = {}, {}
                    for a in (0, 1, 2):
                        ca = replace(cfg, asm=a)
                        ta = time_in_graph(lambda p, c=ca: launch(x, p, None, c), copies, dev)
                        err = (launch(x, pw, None, ca).float() - ref).abs().max() / ref.abs().max()
                        row["asm_us"][a], row["asm_max_rel_err"][a] = round(ta * 1e3, 2), float(f"{err:.2e}")
                if sweep and name in sweep_shapes and fmt != "w4g32":
                    res = []
                    for c in sweep_configs(m, pw.bits):
                        try:
                            res.append((time_in_graph(lambda p, c=c: launch(x, p, None, c), copies, dev), _short(c)))
                        except Exception as e:  # noqa: BLE001 - a config that does not compile: report, go on
                            print("config", _short(c), "failed:", type(e).__name__, str(e)[:200])
                    res.sort()
                    row["sweep_best"] = [(c, round(pw.nbytes / tc / 1e6 / copy_gbps, 3)) for tc, c in res[:4]]
                rows.append(row)
                print(json.dumps(row), flush=True)
                del copies
        del w, fp16_copies, packed
        torch.cuda.empty_cache()
    return head, rows


def _short(c) -> str:
    return f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}w{c.num_warps}p{c.num_stages}x{c.x_split}a{c.asm}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="1,16,64", help="row counts M, comma-separated")
    p.add_argument("--sweep", action="store_true", help="also time a grid of block configurations")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"weight formats among {','.join(FORMATS)}")
    p.add_argument("--shapes", default="qkv,down", help="the projections --sweep times")
    p.add_argument("--tune", action="store_true", help="let quant_linear time its candidates (ROOFLM_QUANT_TUNE=1)")
    p.add_argument("--json", default=None, help="write every figure to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant needs a CUDA GPU")
    if args.tune:
        import os

        os.environ["ROOFLM_QUANT_TUNE"] = "1"
    formats = tuple(args.formats.split(","))
    for f in formats:
        if f not in FORMATS:
            raise SystemExit(f"--formats {args.formats}: {f!r} is not one of {', '.join(FORMATS)}")
    head, rows = bench(tuple(int(v) for v in args.ms.split(",")), sweep=args.sweep,
                       sweep_shapes=tuple(args.shapes.split(",")), formats=formats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": head, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
