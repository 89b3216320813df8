"""Fused-prologue projections against their unfused pairs on the running GPU:
``python -m rooflm.kernels.bench_fused [--ms 1,2,4,8,16] [--model] [--json FILE]``.

For Llama-2-7B's three fused pairs (add + RMSNorm -> qkv_proj, add + RMSNorm -> gate_up_proj, SiLU-and-mul ->
down_proj) and each row count: the elementwise kernel alone, the GEMV alone (``gemv.linear``'s pick), the unfused pair,
every fused candidate, and the fused dispatcher's pick, each replayed from a CUDA graph over weight copies larger than
the L2 (``gemv.time_in_graph``), in microseconds per call.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

SHAPES = {"norm_qkv": ("rmsnorm", 12288, 4096), "norm_gate_up": ("rmsnorm", 22016, 4096),
          "silu_down": ("silu_mul", 4096, 11008)}


def bench(ms=(1, 2, 4, 8, 16), dtype=torch.float16) -> list[dict]:
    from rooflm.kernels import fused_gemv as fg
    from rooflm.kernels.activation import silu_and_mul
    from rooflm.kernels.gemv import CANDIDATES, linear, time_in_graph, weight_copies
    from rooflm.kernels.rmsnorm import rms_norm

    rows = []
    dev = torch.device("cuda")
    for name, (kind, n, k) in SHAPES.items():
        w = torch.randn(n, k, dtype=dtype, device=dev) / math.sqrt(k)
        copies = weight_copies(w)
        nw = (1 + 0.1 * torch.randn(k, device=dev)).to(dtype)
        for m in ms:
            width = k if kind == "rmsnorm" else 2 * k
            x = torch.randn(m, width, dtype=dtype, device=dev)
            r = torch.randn(m, width, dtype=dtype, device=dev)
            if kind == "rmsnorm":
                def pre(x=x, r=r):
                    return rms_norm(x, nw, 1e-5, r)[0]

                def fused(v, ww, x=x, r=r):
                    return fg.rmsnorm_gemv(x, nw, 1e-5, ww, None, v[0], r, one_pass=v[1])

                pick = fg.pick_rmsnorm_gemv(x, w, None, 1e-5)
                variants = [(c, False) for c in CANDIDATES if c.supports(m)]
                variants += [(c, True) for c in CANDIDATES if m == 1 and not c.use_dot and c.split_k == 1]
            else:
                def pre(x=x):
                    return silu_and_mul(x)

                def fused(c, ww, x=x):
                    return fg.silu_mul_gemv(x, ww, None, c)

                pick = fg.pick_silu_mul_gemv(x, w, None)
                variants = [c for c in CANDIDATES if c.supports(m)]
            h = pre()
            res = {"pre_alone": time_in_graph(lambda ww: pre(), copies, dev),
                   "gemv_alone": time_in_graph(lambda ww, h=h: linear(h, ww), copies, dev),
                   "unfused": time_in_graph(lambda ww: linear(pre(), ww), copies, dev)}
            for v in variants:
                res["fused_" + fg._name(v)] = time_in_graph(lambda ww, v=v: fused(v, ww), copies, dev)
            best = min((v, key) for key, v in res.items() if key.startswith("fused_"))
            rows.append({"pair": name, "m": m, "n": n, "k": k, "pick": fg._name(pick),
                         "unfused_us": res["unfused"] * 1e3, "best_fused_us": best[0] * 1e3,
                         "best_fused": best[1][6:], "gain_us": (res["unfused"] - best[0]) * 1e3,
                         "weight_gbps": n * k * 2 / best[0] / 1e6,
                         "all_us": {key: round(v * 1e3, 2) for key, v in sorted(res.items(), key=lambda t: t[1])}})
        del w, copies
        torch.cuda.empty_cache()
    return rows


def model_decode(ctx: int = 1088, batch: int = 1, rounds: int = 3, profile: str | None = None) -> dict:
    """One decode step of Llama-2-7B (dummy weights, fp16, the loader's Triton path) at ``ctx`` tokens of context,
    captured in a CUDA graph, with the fused projections on and off (their ``fuse`` switch), alternately ``rounds``
    times: milliseconds per step (median of 20 replays each). ``profile``: also write the kernel table of 5 replays
    of each graph there."""
    from rooflm.attention.metadata_utils import allocate_kv_caches, build_attention_metadata
    from rooflm.layers.activation import SiluAndMulLinear
    from rooflm.layers.norm import RMSNormLinear
    from rooflm.loader import load_model

    from rooflm.kernels.bench import _events_ms

    model, cfg = load_model("llama-2-7b", "dummy", torch.float16, "cuda", show_progress=False)
    bs = 16
    nblk = math.ceil((ctx + 1) / bs)
    caches = allocate_kv_caches(cfg.num_hidden_layers, batch * nblk, bs, cfg.num_key_value_heads, cfg.head_dim,
                                torch.float16, "cuda")
    for c in caches:
        c.normal_()
    tables = [[b * nblk + i for i in range(nblk)] for b in range(batch)]
    meta, pos = build_attention_metadata(tables, [ctx - 1] * batch, [1] * batch, bs, "cuda")
    ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    fused_ops = [m for m in model.modules() if isinstance(m, (RMSNormLinear, SiluAndMulLinear))]

    @torch.no_grad()
    def step():
        return model.compute_logits(model(ids, pos, caches, meta))

    graphs, logits = {}, {}
    for mode in ("unfused", "fused"):
        for m in fused_ops:
            m.fuse = mode == "fused"
        step()
        step()  # compiles and picks outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            logits[mode] = step()
        graphs[mode] = g
    res: dict = {"unfused_ms": [], "fused_ms": []}
    for _ in range(rounds):
        for mode in ("unfused", "fused"):
            res[mode + "_ms"].append(_events_ms(graphs[mode].replay, reps=20, warmup=2))
    torch.cuda.synchronize()
    a, b = logits["unfused"].float(), logits["fused"].float()
    res["logits_rel_diff"] = ((a - b).norm() / a.norm()).item()
    res["argmax_equal"] = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
    res["picks"] = {str(k[:4]): fg_name(v) for k, v in _fused_choices().items()}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with open(profile, "w") as f:
            for mode, g in graphs.items():
                with prof(activities=[ProfilerActivity.CUDA]) as p:
                    for _ in range(5):
                        g.replay()
                    torch.cuda.synchronize()
                f.write(f"== {mode} (5 steps)\n")
                f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
                f.write("\n")
    return res


def fg_name(v) -> str:
    from rooflm.kernels.fused_gemv import _name

    return _name(v)


def _fused_choices() -> dict:
    from rooflm.kernels.fused_gemv import choices

    return choices()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ms", default="1,2,4,8,16", help="row counts, comma-separated")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--model", action="store_true", help="also time a Llama-2-7B decode step, fused on and off")
    p.add_argument("--profile", default=None, help="with --model: write the kernel tables of both graphs here")
    args = p.parse_args(argv)
    rows = bench(tuple(int(v) for v in args.ms.split(",")))
    for row in rows:
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "all_us"}))
    out: dict = {"pairs": rows}
    if args.model:
        out["model"] = model_decode(profile=args.profile)
        print(json.dumps(out["model"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
