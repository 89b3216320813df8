"""Kernel microbenchmarks on the running GPU: ``python -m rooflm.kernels.bench [--sections ...] [--json FILE]``.

Every figure is set against a ceiling measured in the same process: device copy bandwidth (bytes read + written by a
1 GiB device-to-device copy), read bandwidth (a reduction over 2 GiB) and the dense fp16/bf16 matmul rate
(8192^3). GEMV timings flush the L2 before each run, so weights come from device memory as in a real decode step.
The ``decode`` section runs a synthetic Llama-2-7B-shaped decode step (random weights, 32 layers) built only from
rooflm's kernels, captured in a CUDA graph: the kernels' own ceiling for batch-1 decode, before any engine overhead.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch


def _events_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def ceilings() -> dict:
    from rooflm.roofline.measure import measure_bandwidth, measure_matmul_peak

    dev = torch.cuda.get_device_properties(0)
    big = torch.empty(1 << 30, dtype=torch.float16, device="cuda").normal_()  # 2 GiB
    read_ms = _events_ms(lambda: big.sum(dtype=torch.float32))
    big = None  # frees the 2 GiB
    out = {"device": dev.name, "sms": dev.multi_processor_count, "l2_mb": getattr(dev, "L2_cache_size", 0) / 2**20,
           "copy_gbps": measure_bandwidth("cuda", nbytes=2**30, reps=20) / 1e9,  # bytes read + written
           "read_gbps": 2 * (1 << 30) / read_ms / 1e6}
    for dt in (torch.float16, torch.bfloat16):
        key, peak = measure_matmul_peak("cuda", n=8192, reps=10, dtype=dt)
        out[f"matmul_{str(dt)[6:]}_tflops"] = peak / 1e12
    torch.cuda.empty_cache()
    return out


LLAMA7B_SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
                  "lm_head": (32000, 4096)}


def gemv_sweep(ms=(1, 2, 4, 8, 16), dtype=torch.float16) -> list[dict]:
    """Each candidate and torch's linear, timed from a CUDA graph over weight copies larger than the L2."""
    from rooflm.kernels.gemv import GemvConfig, gemv, time_in_graph, weight_copies

    sweep = [GemvConfig(False, bn, bk, s, w, st) for bn, bk, s, w, st in (
        (16, 256, 1, 4, 3), (32, 256, 1, 8, 3), (8, 512, 1, 4, 3), (16, 512, 1, 4, 2), (4, 1024, 1, 4, 2),
        (8, 1024, 1, 8, 2), (4, 512, 1, 2, 3), (8, 256, 1, 2, 3), (16, 256, 2, 4, 3), (8, 512, 2, 4, 3),
        (8, 512, 4, 4, 3), (16, 128, 1, 4, 4))]
    sweep += [GemvConfig(True, bn, bk, s, w, st) for bn, bk, s, w, st in (
        (32, 128, 1, 4, 4), (64, 128, 1, 4, 4), (32, 256, 1, 4, 3), (64, 256, 1, 8, 3), (16, 256, 1, 4, 4),
        (16, 512, 1, 4, 3), (32, 128, 2, 4, 4), (32, 128, 4, 4, 4), (16, 256, 2, 4, 4), (16, 256, 4, 4, 4),
        (64, 64, 1, 4, 6))]
    rows = []
    for name, (n, k) in LLAMA7B_SHAPES.items():
        w = torch.randn(n, k, dtype=dtype, device="cuda") / math.sqrt(k)
        copies = weight_copies(w)
        for m in ms:
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            nbytes = (n * k + m * k + m * n) * 2
            res = {"torch": time_in_graph(lambda ww: torch.nn.functional.linear(x, ww), copies, x.device)}
            for cfg in sweep:
                if cfg.supports(m):
                    try:
                        res[_cfg_name(cfg)] = time_in_graph(lambda ww, c=cfg: gemv(x, ww, None, c), copies, x.device)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile: report, go on
                        print("gemv", _cfg_name(cfg), "failed:", type(e).__name__, str(e)[:200])
            best = min(res, key=res.get)
            rows.append({"shape": name, "n": n, "k": k, "m": m, "best": best, "best_us": res[best] * 1e3,
                         "best_gbps": nbytes / res[best] / 1e6, "torch_us": res["torch"] * 1e3,
                         "torch_gbps": nbytes / res["torch"] / 1e6,
                         "top5": [(c, round(t * 1e3, 2)) for c, t in sorted(res.items(), key=lambda r: r[1])[:5]],
                         "all_us": {c: round(t * 1e3, 2) for c, t in sorted(res.items(), key=lambda r: r[1])}})
        del w, copies
    return rows


def graph_ms(calls, rounds: int = 1, reps: int = 5) -> float:
    """Milliseconds of one pass over ``calls`` (zero-argument callables), replayed from a CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for c in calls:
                c()
    ms = _events_ms(g.replay, reps=reps, warmup=1) / rounds
    del g
    return ms


def _cfg_name(c) -> str:
    return f"{'dot' if c.use_dot else 'sum'}{c.block_n}x{c.block_k}s{c.split_k}w{c.num_warps}p{c.num_stages}"


def decode_attention_bench(dtype=torch.float16) -> list[dict]:
    """Decode attention replayed from a CUDA graph over 8 caches (as 8 layers), per call. Variants: the default plan,
    with programmatic dependent launch (pdl) and/or the fused reduction, one split, 8 splits, tl.dot forced."""
    from rooflm.kernels.decode_attention import paged_decode_attention

    rows = []
    for batch, heads, kv_heads, ctx in ((1, 32, 32, 1024), (1, 32, 8, 4096), (32, 32, 32, 1024), (8, 32, 8, 8192)):
        bs, d, layers = 16, 128, 8
        nblk = batch * math.ceil(ctx / bs) + 1
        caches = [torch.randn(2, nblk, bs, kv_heads, d, dtype=dtype, device="cuda") for _ in range(layers)]
        tables = torch.randperm(nblk - 1, device="cuda")[: batch * math.ceil(ctx / bs)].view(batch, -1).int()
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, d, dtype=dtype, device="cuda")
        nbytes = 2 * batch * ctx * kv_heads * d * 2
        res = {}
        variants = {"auto": {}, "auto-pdl": {"pdl": True}, "auto-fused": {"fused_reduce": True},
                    "auto-fused-pdl": {"fused_reduce": True, "pdl": True}, "1": {"num_splits": 1},
                    "8": {"num_splits": 8}, "dot": {"use_dot": True}, "16x64": {"num_splits": 16, "block_n": 64}}
        for name, kw in variants.items():
            calls = [lambda kw=kw, c=c: paged_decode_attention(q, c, tables, seq_lens, d ** -0.5, **kw)
                     for c in caches]
            res[name] = graph_ms(calls) / layers
        rows.append({"batch": batch, "heads": heads, "kv_heads": kv_heads, "ctx": ctx,
                     "us": {k: round(v * 1e3, 2) for k, v in res.items()},
                     "gbps_auto": nbytes / res["auto"] / 1e6, "gbps_best": nbytes / min(res.values()) / 1e6})
        del caches
    return rows


def decode_step_inputs(batch: int, heads: int, kv_heads: int, ctx: int, dtype=torch.float16, layers: int = 8,
                       bs: int = 16, d: int = 128):
    """Random inputs of one decode step per layer at context ``ctx``: (caches, tables, seq_lens, q, NewTokenKV), the
    caches one per layer (together larger than the L2), the new token's slot the last position of each sequence."""
    from rooflm.kernels.decode_attention import NewTokenKV

    nblk = batch * math.ceil(ctx / bs) + 1
    caches = [torch.randn(2, nblk, bs, kv_heads, d, dtype=dtype, device="cuda") for _ in range(layers)]
    tables = torch.randperm(nblk - 1, device="cuda")[: batch * math.ceil(ctx / bs)].view(batch, -1).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    slots = (tables[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs).contiguous()
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d, dtype=dtype, device="cuda")
    q, k, v = (t.view(batch, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    angles = torch.rand(batch, d // 2, device="cuda") * 6
    return caches, tables, seq_lens, q, NewTokenKV(k, v, angles.cos().to(dtype), angles.sin().to(dtype), slots)


def decode_rope_bench(dtype=torch.float16) -> list[dict]:
    """A decode layer's rotary + cache write and attention: the rotary kernel then decode attention, against decode
    attention doing both (``NewTokenKV``); CUDA-graph replays over 8 caches (as 8 layers), per layer."""
    from rooflm.kernels._utils import device_sms
    from rooflm.kernels.decode_attention import default_plan, paged_decode_attention
    from rooflm.kernels.kv_cache import rotary_write_kv_cache

    rows = []
    shapes = [(b, h, kvh, c) for b in (1, 2, 4, 8, 16, 32) for h, kvh in ((32, 32), (32, 8)) for c in (1024, 4096)]
    for batch, heads, kv_heads, ctx in [(1, 20, 20, 1024), (1, 40, 40, 1024), (8, 32, 8, 8192)] + shapes:
        d, layers = 128, 8
        caches, tables, seq_lens, q, new = decode_step_inputs(batch, heads, kv_heads, ctx, dtype, layers, d=d)
        k, v, cos, sin, slots = new.k, new.v, new.cos, new.sin, new.slot_mapping
        two = [lambda c=c: (rotary_write_kv_cache(q, k, v, None, cos, sin, c, slots),
                            paged_decode_attention(q, c, tables, seq_lens, d ** -0.5)) for c in caches]
        one = [lambda c=c: paged_decode_attention(q, c, tables, seq_lens, d ** -0.5, new_kv=new) for c in caches]
        res = {"two_kernels": graph_ms(two) / layers, "fused": graph_ms(one) / layers,
               "attention_only": graph_ms([lambda c=c: paged_decode_attention(q, c, tables, seq_lens, d ** -0.5)
                                           for c in caches]) / layers}
        plan = default_plan(batch, kv_heads, heads // kv_heads, device_sms(q))
        rows.append({"batch": batch, "heads": heads, "kv_heads": kv_heads, "ctx": ctx, "splits": plan.num_splits,
                     "dot": plan.use_dot, "us": {k: round(v * 1e3, 2) for k, v in res.items()},
                     "saved_us": round((res["two_kernels"] - res["fused"]) * 1e3, 2)})
        del caches
    return rows


def prefill_attention_bench(dtype=torch.float16) -> list[dict]:
    from rooflm.kernels.prefill_attention import paged_prefill_attention

    rows = []
    T, H, D, bs = 2048, 32, 128, 16
    for kv_heads in (32, 8):
        nblk = T // bs
        cache = torch.randn(2, nblk, bs, kv_heads, D, dtype=dtype, device="cuda")
        tables = torch.arange(nblk, dtype=torch.int32, device="cuda")[None]
        q = torch.randn(T, H, D, dtype=dtype, device="cuda")
        qsl = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        sl = torch.tensor([T], dtype=torch.int32, device="cuda")
        flops = 4 * T * T * H * D / 2
        res = {}
        for tiles in (None, (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 4),
                      (128, 32, 4, 3)):
            try:
                ms = _events_ms(lambda t=tiles: paged_prefill_attention(q, cache, qsl, sl, tables, T, D ** -0.5,
                                                                        tiles=t), reps=10)
                res["default" if tiles is None else "x".join(map(str, tiles))] = ms
            except Exception as e:  # a tile too large for shared memory
                res["x".join(map(str, tiles))] = float("nan")
                print("prefill tiles", tiles, "failed:", type(e).__name__)
        kk = cache[0].reshape(T, kv_heads, D).repeat_interleave(H // kv_heads, 1).transpose(0, 1)[None]
        vv = cache[1].reshape(T, kv_heads, D).repeat_interleave(H // kv_heads, 1).transpose(0, 1)[None]
        qq = q.transpose(0, 1)[None]
        sdpa = _events_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True),
                          reps=10)
        from rooflm.attention.dense_prefill import attend as dense_attend
        from rooflm.attention.metadata_utils import build_attention_metadata

        # the engine's layout: q, k and v are column slices of one [T, (H + 2 * H_kv) * D] projection output
        meta, _ = build_attention_metadata([list(range(nblk))], [0], [T], bs, "cuda")
        qkv = torch.cat([q.reshape(T, H * D), cache[0].reshape(T, -1), cache[1].reshape(T, -1)], dim=1)
        qs, ks, vs = qkv.split([H * D, kv_heads * D, kv_heads * D], dim=1)
        dense = _events_ms(lambda: dense_attend(qs.view(T, H, D), ks.view(T, kv_heads, D), vs.view(T, kv_heads, D),
                                                meta, D ** -0.5), reps=10)
        best = min((v for v in res.values() if v == v), default=float("nan"))
        rows.append({"tokens": T, "heads": H, "kv_heads": kv_heads,
                     "us": {k: round(v * 1e3, 1) for k, v in res.items()},
                     "tflops_default": flops / res["default"] / 1e9, "tflops_best": flops / best / 1e9,
                     "sdpa_contiguous_tflops": flops / sdpa / 1e9,
                     "dense_prefill_tflops": flops / dense / 1e9})  # rooflm.attention.dense_prefill
    return rows


def elementwise_bench(dtype=torch.float16) -> list[dict]:
    """Small fused kernels, per call, replayed 32 times from a CUDA graph (launch overhead excluded)."""
    from rooflm.kernels.activation import silu_and_mul
    from rooflm.kernels.rmsnorm import rms_norm

    rows = []
    for T in (1, 32, 2048):
        x = torch.randn(T, 4096, dtype=dtype, device="cuda")
        r = torch.randn_like(x)
        w = torch.randn(4096, dtype=dtype, device="cuda")
        ms = graph_ms([lambda: rms_norm(x, w, 1e-5, r)], rounds=32)
        rows.append({"op": "add_rmsnorm", "tokens": T, "us": ms * 1e3, "gbps": 4 * x.numel() * 2 / ms / 1e6})
        g = torch.randn(T, 22016, dtype=dtype, device="cuda")
        ms = graph_ms([lambda: silu_and_mul(g)], rounds=32)
        rows.append({"op": "silu_and_mul", "tokens": T, "us": ms * 1e3, "gbps": 1.5 * g.numel() * 2 / ms / 1e6})
    return rows


class SyntheticLlama:
    """A Llama-2-7B-shaped decoder made only of rooflm kernels and random weights (fused QKV and gate/up)."""

    def __init__(self, batch: int, ctx: int, layers: int = 32, hidden: int = 4096, inter: int = 11008,
                 heads: int = 32, kv_heads: int = 32, vocab: int = 32000, dtype=torch.float16, block_size: int = 16,
                 dev: str = "cuda"):
        self.h, self.heads, self.kvh, self.d = hidden, heads, kv_heads, hidden // heads
        qkv_n = (heads + 2 * kv_heads) * self.d

        def w(n, k):
            return (torch.rand(n, k, dtype=dtype, device=dev) - 0.5) * (2 / math.sqrt(k))

        self.layers = [dict(qkv=w(qkv_n, hidden), o=w(hidden, hidden), gu=w(2 * inter, hidden),
                            down=w(hidden, inter), n1=torch.ones(hidden, dtype=dtype, device=dev),
                            n2=torch.ones(hidden, dtype=dtype, device=dev)) for _ in range(layers)]
        self.lm_head = w(vocab, hidden)
        self.final_norm = torch.ones(hidden, dtype=dtype, device=dev)
        self.weight_bytes = sum(t.numel() * t.element_size() for L in self.layers for t in L.values())
        self.weight_bytes += self.lm_head.numel() * 2
        nblk = math.ceil((ctx + 64) / block_size)
        self.caches = [torch.randn(2, batch * nblk, block_size, kv_heads, self.d, dtype=dtype, device=dev)
                       for _ in range(layers)]
        self.block_tables = torch.arange(batch * nblk, dtype=torch.int32, device=dev).view(batch, nblk)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        self.positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device=dev)
        self.slots = (self.block_tables[:, (ctx - 1) // block_size].long() * block_size + (ctx - 1) % block_size)
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.d, 2, dtype=torch.float32, device=dev) / self.d))
        ang = torch.arange(4096, dtype=torch.float32, device=dev)[:, None] * inv[None]
        self.cos, self.sin = ang.cos(), ang.sin()
        self.x = torch.randn(batch, hidden, dtype=dtype, device=dev) * 0.1
        self.kv_bytes = 2 * batch * ctx * kv_heads * self.d * 2 * layers

    def parts_ms(self, linear) -> dict:
        """The step's kernels by kind, each kind alone replayed from a CUDA graph over all layers (ms)."""
        from rooflm.kernels.activation import silu_and_mul
        from rooflm.kernels.decode_attention import paged_decode_attention
        from rooflm.kernels.kv_cache import rotary_write_kv_cache
        from rooflm.kernels.rmsnorm import rms_norm

        B, H, D = self.x.shape[0], self.heads, self.d
        xh = self.x
        xi = torch.randn(B, self.layers[0]["down"].shape[1], dtype=xh.dtype, device=xh.device)
        q = torch.randn(B, H, D, dtype=xh.dtype, device=xh.device)
        kv = torch.randn(B, 2, self.kvh, D, dtype=xh.dtype, device=xh.device)
        gu = torch.randn(B, self.layers[0]["gu"].shape[0], dtype=xh.dtype, device=xh.device)
        out = {}
        for kind in ("qkv", "o", "gu", "down"):
            src = xi if kind == "down" else xh
            out["linear_" + kind] = graph_ms([lambda L=L, k=kind, s=src: linear(s, L[k]) for L in self.layers])
        out["lm_head"] = graph_ms([lambda: linear(xh, self.lm_head)])
        out["attention"] = graph_ms([lambda c=c: paged_decode_attention(q, c, self.block_tables, self.seq_lens,
                                                                         D ** -0.5) for c in self.caches])
        out["rotary_cache"] = graph_ms([lambda c=c: rotary_write_kv_cache(q, kv[:, 0], kv[:, 1], self.positions,
                                                                          self.cos, self.sin, c, self.slots)
                                        for c in self.caches])
        out["norms"] = graph_ms([lambda L=L: rms_norm(xh, L["n1"], 1e-5, xh) for L in self.layers] * 2)
        out["silu"] = graph_ms([lambda: silu_and_mul(gu)] * len(self.layers))
        out["sum"] = sum(out.values())
        return out

    def step(self, linear) -> torch.Tensor:
        from rooflm.kernels.activation import silu_and_mul
        from rooflm.kernels.decode_attention import paged_decode_attention
        from rooflm.kernels.kv_cache import rotary_write_kv_cache
        from rooflm.kernels.rmsnorm import rms_norm

        B = self.x.shape[0]
        h, res = self.x, None
        qs, ks = self.heads * self.d, self.kvh * self.d
        for L, cache in zip(self.layers, self.caches):
            if res is None:
                n, res = rms_norm(h, L["n1"], 1e-5), h
            else:
                n, res = rms_norm(h, L["n1"], 1e-5, res)
            qkv = linear(n, L["qkv"])
            q = qkv[:, :qs].view(B, self.heads, self.d)
            k = qkv[:, qs:qs + ks].view(B, self.kvh, self.d)
            v = qkv[:, qs + ks:].view(B, self.kvh, self.d)
            rotary_write_kv_cache(q, k, v, self.positions, self.cos, self.sin, cache, self.slots)
            a = paged_decode_attention(q, cache, self.block_tables, self.seq_lens, self.d ** -0.5)
            o = linear(a.view(B, -1), L["o"])
            n, res = rms_norm(o, L["n2"], 1e-5, res)
            h = linear(silu_and_mul(linear(n, L["gu"])), L["down"])
        n, _ = rms_norm(h, self.final_norm, 1e-5, res)
        return linear(n, self.lm_head)


def synthetic_decode(batches=(1, 32), ctx: int = 1088) -> list[dict]:
    """Llama-2-7B-shaped decode steps from rooflm kernels, eager and in a CUDA graph, with the GEMV dispatcher and
    with torch's linear. ctx 1088 = the middle of a 1024 + 128 generation."""
    from rooflm.kernels.gemv import linear, linear_ref

    rows = []
    for batch in batches:
        model = SyntheticLlama(batch, ctx)
        for name, lin in (("gemv-dispatch", linear), ("torch-linear", linear_ref)):
            t0 = time.perf_counter()
            model.step(lin)  # compiles + tunes
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            eager_ms = _events_ms(lambda: model.step(lin), reps=5, warmup=1)
            t0 = time.perf_counter()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                model.step(lin)
            torch.cuda.synchronize()
            cap_s = time.perf_counter() - t0
            step_ms = _events_ms(g.replay, reps=30)
            nbytes = model.weight_bytes + model.kv_bytes
            parts = model.parts_ms(lin)
            rows.append({"batch": batch, "ctx": ctx, "linear": name, "warmup_s": warm_s, "capture_s": cap_s,
                         "eager_ms": eager_ms, "graph_ms": step_ms, "tokens_per_s": batch * 1e3 / step_ms,
                         "gbps": nbytes / step_ms / 1e6, "bytes": nbytes,
                         "parts_ms": {k: round(v, 3) for k, v in parts.items()}})
            del g
        model = None  # frees its weights before the next batch
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sections", default="ceilings,gemv,decode_attn,prefill_attn,elementwise,decode")
    p.add_argument("--json", default=None, help="write every figure to this file")
    args = p.parse_args(argv)
    out: dict = {}
    for sec in args.sections.split(","):
        t0 = time.perf_counter()
        fn = {"ceilings": ceilings, "gemv": gemv_sweep, "decode_attn": decode_attention_bench,
              "decode_rope": decode_rope_bench,
              "prefill_attn": prefill_attention_bench, "elementwise": elementwise_bench,
              "decode": synthetic_decode}[sec]
        out[sec] = fn()
        print(f"== {sec} ({time.perf_counter() - t0:.1f} s)", flush=True)
        if isinstance(out[sec], dict):
            print(json.dumps(out[sec], indent=None, default=float))
        else:
            for row in out[sec]:
                print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                                  if k != "all_us"}))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
