"""How close can a decode step's chain of GEMVs get to the memory bandwidth?

Builds Llama-2-7B's 32 layers of projections at one row (qkv, o, gate_up, down; random float16 weights, 12.9 GB),
chains them so that each GEMV reads the previous one's output, captures the chain in one CUDA graph and times its
replays. Prints, beside the copy bandwidth and two read-only streams measured in the same run (one 2 GiB read, and
the chain's own weights read by one launch per matrix), the chain's time and bandwidth for torch's linear and for
rooflm's tuned GEMV (``rooflm.kernels.gemv.linear``); ``--sweep`` adds single-shape timings of more tile shapes.

    PYTHONPATH=src python3 tests/gpu/gemv_chain_bench.py [--layers 32] [--reps 10]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from rooflm.kernels import gemv as G


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_stream(x: torch.Tensor, out: torch.Tensor, block: int = 4096, iters: int = 8) -> None:
    n = x.numel()
    grid = (triton.cdiv(n, block * iters),)
    _read_kernel[grid](x, out, n, BLOCK=block, ITERS=iters, num_warps=8)


def time_graph(fn, reps: int) -> float:
    """Milliseconds of one ``fn()``, replayed from a CUDA graph (``rooflm.kernels.gemv.time_in_graph``)."""
    return G.time_in_graph(lambda _: fn(), [None], torch.device("cuda"), reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    H, I = 4096, 11008
    shapes = {"qkv": (3 * H, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
    layers = []
    for _ in range(args.layers):
        layers.append({k: torch.randn(n, kk, dtype=torch.float16, device=dev) * kk ** -0.5
                       for k, (n, kk) in shapes.items()})
    nbytes = sum(w.numel() * 2 for L in layers for w in L.values())
    x0 = torch.randn(1, H, dtype=torch.float16, device=dev)

    # Copy and read ceilings.
    bufs = [torch.empty(2**30, dtype=torch.float16, device=dev).normal_() for _ in range(2)]
    t_copy = time_graph(lambda: bufs[1].copy_(bufs[0]), args.reps)
    copy_bw = 2 * bufs[0].numel() * 2 / t_copy / 1e6
    red = torch.empty(1 << 20, dtype=torch.float32, device=dev)
    t_read = time_graph(lambda: read_stream(bufs[0], red), args.reps)
    read_bw = bufs[0].numel() * 2 / t_read / 1e6
    bufs.clear()
    t_read_chain = time_graph(lambda: [read_stream(w, red) for L in layers for w in L.values()], args.reps)
    print(f"copy {copy_bw:.0f} GB/s; one 2 GiB read {read_bw:.0f} GB/s; the chain's weights read as "
          f"{4 * args.layers} launches: {t_read_chain:.3f} ms = {nbytes / t_read_chain / 1e6:.0f} GB/s")

    def chain(lin):
        def run():
            x = x0
            for L in layers:
                qkv = lin(x, L["qkv"], None)
                o = lin(qkv[:, :H], L["o"], None)
                gu = lin(o, L["gate_up"], None)
                x = lin(gu[:, :I], L["down"], None)
            return x
        return run

    ref = chain(torch.nn.functional.linear)()
    rows = [("torch linear", G.linear_ref), ("rooflm gemv (tuned)", G.linear)]
    G.linear(x0, layers[0]["qkv"])  # tune each shape outside the capture
    for k in shapes:
        G.linear(torch.randn(1, layers[0][k].shape[1], dtype=torch.float16, device=dev), layers[0][k])
    picks = {k: G.choose(torch.empty(1, layers[0][k].shape[1], dtype=torch.float16, device=dev), layers[0][k], None)
             for k in shapes}
    print("picks:", {k: (v if isinstance(v, str) else G._short(v)) for k, v in picks.items()})
    if args.sweep:  # single-shape timings of more tile shapes
        extra = [G.GemvConfig(False, bn, bk, 1, nw, ns) for bn, bk, nw, ns in
                 [(4, 1024, 4, 3), (4, 2048, 8, 2), (8, 1024, 8, 2), (2, 2048, 4, 2), (16, 512, 8, 3), (8, 512, 4, 4),
                  (4, 512, 2, 4), (2, 1024, 2, 3), (16, 256, 4, 4), (32, 128, 4, 4)]]
        for k in shapes:
            copies = G.weight_copies(layers[0][k])
            xs = torch.randn(1, layers[0][k].shape[1], dtype=torch.float16, device=dev)
            res = sorted((G.time_in_graph(lambda w, c=c: G.gemv(xs, w, None, c), copies, dev), G._short(c))
                         for c in list(G.CANDIDATES[:5]) + extra)
            nb = layers[0][k].numel() * 2
            print(k, " ".join(f"{n}={t * 1e3:.1f}us({nb / t / 1e9:.0f})" for t, n in res[:6]))
            del copies
    print(f"{'implementation':28s} {'chain ms':>9s} {'GB/s':>6s} {'of copy':>8s} {'max |diff|':>10s}")
    for name, lin in rows:
        out = chain(lin)()
        diff = (out.float() - ref.float()).abs().max().item()
        t = time_graph(chain(lin), args.reps)
        bw = nbytes / t / 1e6
        print(f"{name:28s} {t:9.3f} {bw:6.0f} {bw / copy_bw:8.1%} {diff:10.2e}")


if __name__ == "__main__":
    main()
