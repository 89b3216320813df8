"""How long does one kernel take to read N bytes, for the sizes of a 4-bit Llama-2-7B layer's kernels?

A decode step at batch 1 is a chain of short read-bound kernels. This probe replays, from one CUDA graph, a chain of
32 "layers" of plain read streams whose sizes are those of the W4A16 layer's kernels (qkv, decode attention at 1024
tokens, o, gate_up, down), each over its own buffer (the chain holds many L2s, so every read comes from device
memory), for several stream shapes, and prints per size the best time per kernel against the bytes at the 2 GiB
read rate measured in the same run. The gap is what one kernel boundary costs a pure read of that size; a GEMV of
the same bytes cannot beat it without fusing kernels. It then reads the four projections' 4-bit codes ([N, K / 8]
int32 words) in a word GEMV's tiles (rooflm/kernels/quant_gemv.py: ROWS rows of TILE words at a time along K) with
no scales and no products, over a few tile shapes: if these are much slower than the plain streams of the same
bytes, the order of the GEMV's loads, not the boundary, is what costs.

    PYTHONPATH=src python3 tests/gpu/stream_size_probe.py [--reps 10]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from gemv_chain_bench import read_stream, time_graph  # this script's folder is first on sys.path when it runs


@triton.jit
def _tile_read_kernel(q_ptr, out_ptr, K_WORDS, ROWS: tl.constexpr, TILE: tl.constexpr):
    """A word GEMV's access pattern without its arithmetic: ROWS rows of TILE int32 words at a time along K."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, TILE], tl.int32)
    for k in range(0, K_WORDS, TILE):
        acc += tl.load(q_ptr + rows[:, None] * K_WORDS + k + tl.arange(0, TILE)[None, :])
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def tile_read(q: torch.Tensor, out: torch.Tensor, rows: int, tile: int, warps: int) -> None:
    n, kw = q.shape
    _tile_read_kernel[(n // rows,)](q, out, kw, ROWS=rows, TILE=tile, num_warps=warps)


# bytes of each W4A16 kernel of a Llama-2-7B layer in the step's order (codes + group scales and mins; decode
# attention: the KV of 1024 tokens)
LAYER_BYTES = {"qkv": 26.74e6, "attention": 16.8e6, "o": 8.91e6, "gate_up": 47.91e6, "down": 23.95e6}


def probe_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10, help="graph replays timed")
    ap.add_argument("--layers", type=int, default=32, help="layers of buffers in the chain")
    return ap.parse_args()


def read_rate(out: torch.Tensor) -> float:
    """GB/s of one 2 GiB read stream, replayed from a CUDA graph: the ceiling the probes compare against."""
    big = torch.randint(0, 1 << 10, (512 << 20,), dtype=torch.int32, device=out.device)
    return big.numel() * 4 / time_graph(lambda: read_stream(big, out, 2048, 8), 10) / 1e6


def main() -> None:
    args = probe_args()
    dev = torch.device("cuda")
    sizes = dict(sorted(LAYER_BYTES.items(), key=lambda kv: kv[1]))  # smallest first
    words = {k: int(v) // 4 for k, v in sizes.items()}
    layers = [{k: torch.randint(0, 1 << 30, (w,), dtype=torch.int32, device=dev) for k, w in words.items()}
              for _ in range(args.layers)]
    red = torch.empty(1 << 22, dtype=torch.int32, device=dev)
    fred = torch.empty(1 << 22, dtype=torch.float32, device=dev)
    rate = read_rate(fred)
    print(f"{torch.cuda.get_device_name()}: one 2 GiB read {rate:.0f} GB/s")
    shapes = [(b, it) for b in (1024, 2048, 4096, 8192) for it in (1, 2, 4)]  # read_stream: 8 warps
    best: dict[str, tuple[float, tuple]] = {}
    for k in sizes:
        for s in shapes:
            ms = time_graph(lambda: [read_stream(L[k], fred, *s) for L in layers], args.reps)
            us = ms * 1e3 / args.layers
            if k not in best or us < best[k][0]:
                best[k] = (us, s)
    whole = 0.0
    for k, (us, s) in best.items():
        ideal = sizes[k] / rate / 1e3
        whole += us
        print(f"{k:9s} {sizes[k] / 1e6:5.1f} MB: best {us:6.2f} us (block {s[0]} x {s[1]} iters), "
              f"bytes at the read rate {ideal:5.2f} us, excess {us - ideal:5.2f} us")
    # the whole layer as one chain of the five best streams
    ms = time_graph(lambda: [read_stream(L[k], fred, *best[k][1]) for L in layers for k in sizes], args.reps)
    print(f"a layer of the five streams: {ms * 1e3 / args.layers:.2f} us (sum of the singles {whole:.2f} us, "
          f"bytes at the read rate {sum(sizes.values()) / rate / 1e3:.2f} us)", flush=True)
    del layers
    # the codes of the four projections as [N, K / 8] words, read in a word GEMV's tiles (no scales, no products)
    mats = {"o": (4096, 512), "qkv": (12288, 512), "gate_up": (22016, 512), "down": (4096, 1376)}
    qs = [{k: torch.randint(0, 1 << 30, s, dtype=torch.int32, device=dev) for k, s in mats.items()}
          for _ in range(args.layers)]
    for k, (n, kw) in mats.items():
        res = []
        for rows in (8, 16, 32):
            for tile in (32, 64, 128) if kw % 64 else (64, 128):
                if kw % tile:
                    continue
                for w in (2, 4, 8):
                    if rows * tile < 32 * w:
                        continue
                    ms = time_graph(lambda: [tile_read(Q[k], red, rows, tile, w) for Q in qs], args.reps)
                    res.append((ms * 1e3 / args.layers, rows, tile, w))
        res.sort()
        ideal = n * kw * 4 / rate / 1e3
        print(f"{k:9s} codes {n * kw * 4 / 1e6:5.1f} MB in word-GEMV tiles, bytes at the read rate {ideal:5.2f} us; "
              "fastest (us, rows, words, warps): " + ", ".join(f"{t:.2f} {r}x{c} w{w}" for t, r, c, w in res[:4]),
              flush=True)


if __name__ == "__main__":
    main()
