"""What would one kernel a layer save a 4-bit decode step, for pure reads of its bytes?

A W4A16 Llama-2-7B layer at batch 1 is five read-bound kernels (qkv, decode attention over 1024 tokens, o, gate_up,
down) of 9-48 MB each, and each took 4-7 us more than its bytes on an H100. This probe reads the same bytes (one
buffer a layer, the five kernels' bytes as consecutive slices of it, 32 layers so that the chain holds many L2s) in
five ways, each replayed from one CUDA graph:

* ``five kernels``: one plain read-stream launch a slice (the kernel boundaries of today's step);
* ``one kernel``: one launch reading the whole layer (no boundary at all: the floor);
* ``persistent, no barrier``: one launch of one to four programs a multiprocessor, each striding over the slices;
* ``persistent, 4 grid barriers``: the same, every program waiting after each slice until all are done with it (an
  atomic counter), as a kernel that did a whole layer's dependent steps would have to;
* ``..., first loads before each``: the same, with each program's first tile of the next slice loaded before it
  waits (weights never depend on the step before; only the activations do).

If the barriers cost much less than the kernel boundaries, a persistent layer kernel is worth building; if the floor
itself is far from the bytes, no fusion can help.

    PYTHONPATH=src python3 tests/gpu/layer_fusion_probe.py [--reps 10]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemv_chain_bench import read_stream, time_graph  # this script's folder is first on sys.path when it runs
from stream_size_probe import LAYER_BYTES, probe_args, read_rate


@triton.jit
def _phased_read_kernel(x_ptr, bounds_ptr, cnt_ptr, out_ptr, PHASES: tl.constexpr, BLOCK: tl.constexpr,
                        BARRIER: tl.constexpr, EARLY: tl.constexpr):
    """Programs stride over slice p = bounds[p]..bounds[p + 1] of x, slice after slice; with BARRIER every program
    waits after each slice until all have finished it (``cnt`` counts arrivals; zeroed before the launch). With
    EARLY the first tile of the next slice is loaded before the wait."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    first = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(PHASES):
        lo = tl.load(bounds_ptr + p)
        hi = tl.load(bounds_ptr + p + 1)
        start = lo + pid * BLOCK
        if EARLY and p > 0:  # the first tile of this slice was loaded before the barrier
            acc += first
            start += nprog * BLOCK
        for off in range(start, hi, nprog * BLOCK):
            offs = off + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < hi, other=0).to(tl.float32)
        if p + 1 < PHASES:
            if EARLY:
                nlo = hi + pid * BLOCK
                nhi = tl.load(bounds_ptr + p + 2)
                offs = nlo + tl.arange(0, BLOCK)
                first = tl.load(x_ptr + offs, mask=offs < nhi, other=0).to(tl.float32)
            if BARRIER:
                tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
                target = (p + 1) * nprog
                seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
                while seen < target:
                    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def phased_read(x: torch.Tensor, bounds: torch.Tensor, cnt: torch.Tensor, out: torch.Tensor, programs: int,
                block: int, barrier: bool, early: bool, warps: int = 8) -> None:
    _phased_read_kernel[(programs,)](x, bounds, cnt, out, PHASES=bounds.numel() - 1, BLOCK=block, BARRIER=barrier,
                                     EARLY=early, num_warps=warps)


def main() -> None:
    args = probe_args()
    dev = torch.device("cuda")
    words = [int(v) // 4 // 1024 * 1024 for v in LAYER_BYTES.values()]  # each kernel's bytes as int32 words
    edges = [0]
    for w in words:
        edges.append(edges[-1] + w)
    bounds = torch.tensor(edges, dtype=torch.int32, device=dev)
    layers = [torch.randint(0, 1 << 10, (edges[-1],), dtype=torch.int32, device=dev) for _ in range(args.layers)]
    total = edges[-1] * 4
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = torch.empty(1 << 20, dtype=torch.float32, device=dev)
    cnt = torch.zeros(args.layers, dtype=torch.int32, device=dev)
    rate = read_rate(out)
    print(f"{torch.cuda.get_device_name()} ({sms} SMs): one 2 GiB read {rate:.0f} GB/s; a layer {total / 1e6:.1f} MB, "
          f"its bytes at that rate {total / rate / 1e3:.2f} us")

    def per_layer(ms: float) -> str:
        us = ms * 1e3 / args.layers
        return f"{us:7.2f} us a layer ({total / us / 1e3:5.0f} GB/s)"

    best = min((time_graph(lambda: [read_stream(L[a:b], out, blk, it) for L in layers
                                    for a, b in zip(edges[:-1], edges[1:])], args.reps), blk, it)
               for blk in (1024, 2048, 4096) for it in (1, 2, 4))
    print(f"five kernels (best of 9 shapes, block {best[1]} x {best[2]}): {per_layer(best[0])}", flush=True)
    one = min((time_graph(lambda: [read_stream(L, out, blk, it) for L in layers], args.reps), blk, it)
              for blk in (1024, 2048, 4096) for it in (1, 2, 4))
    print(f"one kernel (best of 9 shapes, block {one[1]} x {one[2]}): {per_layer(one[0])}", flush=True)
    for barrier, early in ((False, False), (True, False), (True, True)):
        name = ("persistent, no barrier" if not barrier else "persistent, 4 grid barriers"
                + (", first loads before each" if early else ""))
        res = []
        for per_sm in (1, 2, 4):
            for block in (1024, 2048):
                def run():
                    cnt.zero_()
                    for i, L in enumerate(layers):
                        phased_read(L, bounds, cnt[i:], out, sms * per_sm, block, barrier, early)
                res.append((time_graph(run, args.reps), per_sm, block))
        res.sort()
        ms, per_sm, block = res[0]
        print(f"{name} (best: {per_sm} programs an SM, block {block}): {per_layer(ms)}", flush=True)
        # the sums must be those of the data (every word read once)
        phased_read(layers[0], bounds, cnt[:1].zero_(), out, sms * per_sm, block, barrier, early)
        got = out[:sms * per_sm].double().sum().item()
        want = layers[0].double().sum().item()
        assert abs(got - want) <= 1e-6 * want, (name, got, want)


if __name__ == "__main__":
    main()
