"""The tensor-core GEMV (``rooflm/kernels/quant_gemv_mma.py``) against the word GEMV on the running GPU, W4A16.

For Llama-2-7B's projections at one row (group 128, with mins): the word GEMV with ``pick_gemv``'s tiles and the
tensor-core GEMV over warps a program and K splits, each replayed from a CUDA graph over weight copies that together
exceed the L2 (``time_in_graph``); microseconds, the fraction of a 2 GiB read stream measured in the same run, and
each kernel's largest error against the float32 product of the dequantized weight (as a fraction of the largest
output).

    PYTHONPATH=src python3 tests/gpu/quant_gemv_mma_sweep.py [--shapes qkv,o,gate_up,down] [--splits 1,2,4,8,16,32]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from dataclasses import replace

import torch


def main(argv=None) -> int:
    os.environ["ROOFLM_QUANT_MMA"] = "1"
    from quant_gemv_sweep import read_stream_gbps

    from rooflm.kernels._utils import packed_copies, time_in_graph
    from rooflm.kernels.bench_quant import SHAPES
    from rooflm.kernels.quant_gemv import launch_gemv, pick_gemv
    from rooflm.kernels.quant_gemv_mma import MmaGemvConfig, launch_mma_gemv, with_mma
    from rooflm.quantization.packed import dequantize
    from rooflm.quantization.rtn import quantize_rtn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qkv,o,gate_up,down")
    p.add_argument("--splits", default="1,2,4,8,16,32")
    p.add_argument("--warps", default="2,4,8")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    stream = read_stream_gbps()
    print(json.dumps({"device": torch.cuda.get_device_name(), "read_stream_gbps": round(stream)}), flush=True)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        torch.manual_seed(0)
        pw = with_mma(quantize_rtn(torch.randn(n, k, dtype=torch.float16, device=dev) / math.sqrt(k), 4, 128))
        plain = replace(pw, mma=None)
        x = torch.randn(1, k, dtype=torch.float16, device=dev)
        ref = x.float() @ dequantize(pw).float().T

        def err(y):
            return float(f"{((y.float() - ref).abs().max() / ref.abs().max()).item():.2e}")

        copies = packed_copies(pw)
        word = pick_gemv(x, plain, None)
        t_word = time_in_graph(lambda w: launch_gemv(x, replace(w, mma=None), None, word), copies, dev)
        rows = []
        for warps, split in itertools.product((int(v) for v in args.warps.split(",")),
                                              (int(v) for v in args.splits.split(","))):
            if (n // 16) % warps or split > k // 128:
                continue
            cfg = MmaGemvConfig(warps, split, True)
            t = time_in_graph(lambda w, c=cfg: launch_mma_gemv(x, w, None, c), copies, dev)
            rows.append((t, f"{warps} warps, K in {split}", err(launch_mma_gemv(x, pw, None, cfg))))
        rows.sort()
        frac = lambda t: round(pw.nbytes / t / 1e6 / stream, 3)  # noqa: E731
        print(json.dumps({"shape": name, "word_gemv": {"config": str(word), "us": round(t_word * 1e3, 2),
                                                       "frac": frac(t_word), "err": err(launch_gemv(x, plain, None,
                                                                                                      word))},
                          "tensor_core_best": [{"config": c, "us": round(t * 1e3, 2), "frac": frac(t), "err": e}
                                               for t, c, e in rows[:4]]}), flush=True)
        del copies
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
