"""The fused packed MLP (``rooflm/kernels/quant_mlp.py``) against the pair of word GEMVs it replaces, on the GPU.

For Llama-2-7B's MLP at one row (gate_up 22016 x 4096, down 4096 x 11008), W4A16 (group 128, with mins) and W8A16
(per channel): the handed-over pair the decode layer runs today (gate_up's word GEMV with the 1/rms scale and
SiLU-and-mul, then down's word GEMV with the next norm's add and statistic, each with ``pick_gemv``'s tile) against
the fused kernel and its reduction, both replayed from CUDA graphs over weight copies beyond the L2
(``time_in_graph``), with plain launches and with the layer's programmatic dependent launches. A first pass times a
grid of tiles with 512 ``down_rows``; a second varies ``down_rows``, the prefetch and the reduction's block around
the three fastest. Each fused result is checked against the pair's output (relative error printed).

    PYTHONPATH=src python3 tests/gpu/quant_mlp_sweep.py [--formats w4g128,w8] [--json OUT]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import replace

import torch


def first_pass(bits: int):
    from rooflm.kernels.quant_mlp import FusedMlpConfig

    for bi, words, warps, pair in itertools.product((32, 64, 128), (32, 64), (4, 8, 16),
                                                    (False, True) if bits == 4 else (False,)):
        per_thread = 2 * bi * words // (32 * warps)
        if 8 <= per_thread <= 32:
            yield FusedMlpConfig(bi, words, 512, warps, 1, pair)


def main(argv=None) -> int:
    from rooflm.kernels._utils import O_TO_GATE_UP, DOWN_TO_QKV
    from rooflm.kernels.gemv import time_in_graph
    from rooflm.kernels.handoff_gemv import packed_add_sumsq, packed_rmsnorm_sumsq_gemv
    from rooflm.kernels.quant_gemv import packed_copies, pick_gemv, pick_gemv_silu_mul, short_name as gshort
    from rooflm.kernels.quant_mlp import fits, fused_mlp, short_name
    from rooflm.quantization.rtn import quantize_rtn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="w4g128,w8")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    formats = {"w4g128": (4, 128), "w8": (8, None)}
    dev = torch.device("cuda")
    hidden, inter, eps = 4096, 11008, 1e-5
    report = {"device": torch.cuda.get_device_name(), "results": {}}
    for fmt in args.formats.split(","):
        bits, group = formats[fmt]
        torch.manual_seed(0)
        gu = quantize_rtn(torch.randn(2 * inter, hidden, dtype=torch.float16, device=dev) / math.sqrt(hidden), bits,
                          group)
        dn = quantize_rtn(torch.randn(hidden, inter, dtype=torch.float16, device=dev) / math.sqrt(inter), bits, group)
        pairs = list(zip(packed_copies(gu), packed_copies(dn)))
        y = torch.randn(1, hidden, dtype=torch.float16, device=dev)
        ss = torch.full((256,), float(hidden) / 256, dtype=torch.float32, device=dev)  # rms 1
        res = torch.randn(1, hidden, dtype=torch.float16, device=dev)
        nw = torch.ones(hidden, dtype=torch.float16, device=dev)
        act0 = torch.randn(1, inter, dtype=torch.float16, device=dev)
        cfg_gu = pick_gemv_silu_mul(y, gu, None) or pick_gemv(y, gu, None)
        cfg_dn = pick_gemv(act0, dn, None)
        rows = {}
        for mode in ("plain", "pdl"):
            plan = (O_TO_GATE_UP.consumer(), DOWN_TO_QKV.producer()) if mode == "pdl" else ({}, {})

            def unfused(w, plan=plan):
                a = packed_rmsnorm_sumsq_gemv(y, ss, eps, w[0], None, cfg_gu, True, **plan[0])
                return packed_add_sumsq(a, w[1], None, cfg_dn, res, nw, **plan[1])[0]

            t = time_in_graph(unfused, pairs, dev)
            rows[f"unfused/{mode}"] = t
            print(f"{fmt} {mode} unfused ({gshort(cfg_gu)} -> {gshort(cfg_dn)}): {t * 1e3:.2f} us", flush=True)
        ref = unfused(pairs[0], ({}, {})).double()

        def fused(w, cfg, mode):
            h = torch.empty_like(res)
            sumsq = torch.empty(-(-hidden // cfg.reduce_block), dtype=torch.float32, device=dev)
            kw = dict(pdl_wait=True, pdl_trigger=2) if mode == "pdl" else {}
            return fused_mlp(y, w[0], w[1], cfg, rstd_sumsq=ss, eps=eps, add_sumsq=(res, nw, h, sumsq), **kw)

        cfgs = {}  # the configuration of each fused row

        def run(cfg, mode="plain"):
            if not fits(gu, dn, cfg):
                return None
            key = f"{short_name(cfg)}/{mode}"
            if key in rows:
                return rows[key]
            try:
                out = fused(pairs[0], cfg, mode).double()
                t = time_in_graph(lambda w: fused(w, cfg, mode), pairs, dev)
            except Exception as e:  # a tile the compiler cannot fit: reported, not fatal
                print(f"{fmt} {key}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                return None
            rel = ((out - ref).norm() / ref.norm()).item()
            rows[key] = t
            cfgs[key] = cfg
            print(f"{fmt} {key}: {t * 1e3:.2f} us (rel. to the pair {rel:.1e})", flush=True)
            return t

        timed = [(run(c), c) for c in first_pass(bits)]
        best = sorted([r for r in timed if r[0] is not None], key=lambda r: r[0])[:3]
        for _, c in best:
            for dr, pf, rb in itertools.product((256, 512, 1024), (0, 1), (16, 32)):
                run(replace(c, down_rows=dr, prefetch=pf, reduce_block=rb))
        for _, k in sorted((t, k) for k, t in rows.items() if k in cfgs)[:4]:  # the four fastest, launched so
            run(cfgs[k], "pdl")
        print(f"{fmt} fastest: " + ", ".join(f"{k}={t * 1e3:.2f}us" for t, k in
                                              sorted((t, k) for k, t in rows.items())[:8]), flush=True)
        report["results"][fmt] = {k: t * 1e3 for k, t in rows.items()}
        del pairs, gu, dn
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
