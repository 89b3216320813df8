"""Small-batch MHA decode attention (rotary + cache write fused, NewTokenKV) per layer against its split count, block
and reduction, against the tl.dot plan with its separate rotary kernel (as the engine runs it): CUDA-graph replays over
8 caches. Usage: [SHAPES="1x32x1024 4x32x4096" SPLITS="8 16 32"] PYTHONPATH=src python3 tests/gpu/decode_split_sweep.py
[OUT.json]"""
import json
import os
import sys

import torch

from rooflm.kernels.bench import decode_step_inputs, graph_ms
from rooflm.kernels.decode_attention import paged_decode_attention

rows = []
dtype = torch.float16
SHAPES = tuple((b, h, c) for b, h, c in (tuple(int(v) for v in s.split("x")) for s in os.environ.get(
    "SHAPES", "1x20x1024 1x32x1024 1x40x1024 1x32x4096 2x32x1024 2x20x1024 4x32x1024").split()))
SPLITS = tuple(int(v) for v in os.environ.get("SPLITS", "8 12 17 24 27 32 48").split())
for batch, heads, ctx in SHAPES:
    d, layers = 128, 8
    caches, tables, seq_lens, q, new = decode_step_inputs(batch, heads, heads, ctx, dtype, layers, d=d)
    k, v, slots = new.k, new.v, new.slot_mapping
    res = {}
    for splits in SPLITS:
        for fused in (False, True):
            for bn, nw in ((16, 1),):
                kw = dict(num_splits=splits, fused_reduce=fused, block_n=bn, num_warps=nw, use_dot=False)
                try:
                    calls = [lambda c=c, kw=kw: paged_decode_attention(q, c, tables, seq_lens, d ** -0.5,
                                                                       new_kv=new, **kw) for c in caches]
                    res[f"s{splits}{'f' if fused else ''}b{bn}w{nw}"] = graph_ms(calls) / layers * 1e3
                except Exception as e:  # noqa: BLE001
                    print("failed", splits, fused, bn, nw, type(e).__name__, str(e)[:120], file=sys.stderr)
    res["default"] = graph_ms([lambda c=c: paged_decode_attention(q, c, tables, seq_lens, d ** -0.5, new_kv=new)
                               for c in caches]) / layers * 1e3
    from rooflm.kernels.decode_attention import default_plan
    plan = default_plan(batch, heads, 1, torch.cuda.get_device_properties(0).multi_processor_count)
    from rooflm.kernels.kv_cache import rotary_write_kv_cache
    for sp in sorted({plan.num_splits, 2 * plan.num_splits, 4 * plan.num_splits}):
        # tl.dot plans are not fused with the step's token: the rotary + cache-write kernel runs first
        res[f"dot{sp}+rotary"] = graph_ms([lambda c=c, sp=sp: (
            rotary_write_kv_cache(q, k, v, None, new.cos, new.sin, c, slots),
            paged_decode_attention(q, c, tables, seq_lens, d ** -0.5, num_splits=sp, use_dot=True))
            for c in caches]) / layers * 1e3
    best = sorted(res.items(), key=lambda r: r[1])[:8]
    print(f"batch={batch} heads={heads} ctx={ctx}: default {res['default']:.2f} us; best",
          ", ".join(f"{n}={t:.2f}" for n, t in best))
    rows.append({"batch": batch, "heads": heads, "ctx": ctx, "us": {k: round(v, 2) for k, v in res.items()}})
    del caches
if len(sys.argv) > 1:
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
