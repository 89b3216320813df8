"""Could a decode layer's five kernels hand their activations over without waiting for whole grids?

Each kernel of a one-row decode step waits for all of the kernel before it (with programmatic dependent launch it is
resident early and loads its first weight tile, then ``griddepcontrol.wait`` holds it until the whole previous grid
has finished and flushed). On an H100, reading a W4A16 Llama-2-7B layer's bytes as five plain launches took 47.0 us
against 40.9 us as one launch (tests/gpu/layer_fusion_probe.py), and a grid-wide barrier inside one persistent
kernel cost more than the boundaries it replaced. Yet a GEMV needs its input one K tile at a time: a program that
multiplies columns k0..k1 needs only the producer's outputs that feed those columns (a norm's 1/rms only at its end).
So the dependency can follow the data: every producer program, after storing its rows, adds one to a counter of its
chunk of the output (release); a consumer program, before each tile, spins on the counters of the chunks that tile
reads (acquire) and never waits for a grid. Producers signal ``griddepcontrol.launch_dependents`` at their start, so
a consumer's programs are scheduled only after every producer program has started: the producers always finish,
and spinning consumers cannot starve them of multiprocessors (no deadlock by construction).

This probe times a chain of 32 layers of five stages shaped as a W4A16 Llama-2-7B layer's codes ([N, K / 8] int32
words: qkv 12288 x 512, attention modelled as 4096 x 1024 (its 16.8 MB of cache), o 4096 x 512, gate_up 22016 x 512,
down 4096 x 1376), each stage a plain product of its words with its input (one int-to-float and one FMA a word, so
the arithmetic is not the limit), stage i + 1's input column k being stage i's output row k * (N_i // K_{i+1}), so
that every consumer needs all of its producer. Four ways, each replayed from one CUDA graph:

* ``stream order``: plain launches, each kernel after the last has finished;
* ``PDL, wait``: today's decode launches (trigger at the start, first tile loaded, then ``griddepcontrol.wait``);
* ``dataflow``: the counters above instead of the wait (qkv and gate_up also wait for every chunk at their end, as
  the norm's 1/rms would);
* ``PDL, no wait``: no dependency at all (wrong values, not checked): the floor of five overlapping launches.

The outputs of ``PDL, wait`` and ``dataflow`` must equal ``stream order``'s bit for bit (same tiles, same order of
sums); the probe asserts it. If ``dataflow`` comes close to ``PDL, no wait`` and well under ``PDL, wait``, handing
activations over by counters is worth building into the decode kernels.

    PYTHONPATH=src python3 tests/gpu/dataflow_probe.py [--reps 10] [--layers 32]

On the CPU (``TRITON_INTERPRET=1``, which runs one program after another) ``--check`` runs a small chain of every
mode and compares the outputs, without timing.
"""
from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from rooflm.kernels._tl import gdc_launch_dependents, gdc_wait

# (N rows, K words) of the five stages of a layer, in the order they run
STAGES = {"qkv": (12288, 512), "attention": (4096, 1024), "o": (4096, 512), "gate_up": (22016, 512),
          "down": (4096, 1376)}
NORM_AFTER = ("qkv", "gate_up")  # stages whose input is normalized: they need all of it before their epilogue
MODES = {"stream order": 0, "PDL, wait": 1, "dataflow": 2, "PDL, no wait": 3}


@triton.jit
def _acquire(flags_ptr, c, need, miss_ptr, GPU: tl.constexpr):
    """Spin until counter ``c`` of the producer reaches ``need`` (acquire at GPU scope). Off a GPU (the interpreter
    runs the producer's programs before any of the consumer's), the counter must already be complete: a wait that
    could never end is counted at ``miss_ptr`` (``check`` asserts none) instead of hanging."""
    seen = tl.atomic_add(flags_ptr + c, 0, sem="acquire", scope="gpu")
    if GPU:
        while seen < need:  # the sleep yields the issue slots to the producer's programs on this multiprocessor
            seen = tl.inline_asm_elementwise("nanosleep.u32 64;\n\tmov.u32 $0, $1;", "=r,r", [seen],
                                             dtype=tl.int32, is_pure=False, pack=1)
            seen = tl.atomic_add(flags_ptr + c, 0, sem="acquire", scope="gpu")
    else:
        tl.atomic_add(miss_ptr, tl.where(seen < need, 1, 0))


@triton.jit
def _wait_chunks(flags_ptr, hi, ready, p_prev, miss_ptr, PPC: tl.constexpr, GPU: tl.constexpr):
    """Wait for the producer's chunks ``ready + 1`` .. ``hi`` (all of them up to ``hi``, in order); returns the last
    chunk known complete."""
    for c in range(ready + 1, hi + 1):
        _acquire(flags_ptr, c, tl.minimum(PPC, p_prev - c * PPC), miss_ptr, GPU)
    return tl.maximum(ready, hi)


@triton.jit
def _stage_kernel(w_ptr, x_ptr, y_ptr, flags_in, flags_out, miss_ptr, N, KW, x_stride, p_prev, scale,
                  BN: tl.constexpr, TW: tl.constexpr, PPC: tl.constexpr, MODE: tl.constexpr, FIRST: tl.constexpr,
                  NORM: tl.constexpr, GDC: tl.constexpr):
    """y[n] = scale * sum_k w[n, k] * x[k * x_stride] for BN rows n, TW words k a tile, the next tile loaded before
    this one's products. MODE: 0 plain, 1 trigger + wait, 2 trigger + chunk counters, 3 trigger only. GDC: on a
    GPU (griddepcontrol, and a sleep in the spin loops); off under the interpreter, which runs one program at a time."""
    pid = tl.program_id(0)
    if MODE != 0 and GDC:
        gdc_launch_dependents()
    rows = pid * BN + tl.arange(0, BN)
    mask_n = rows < N
    cols = tl.arange(0, TW)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * KW
    u = tl.load(w_rows + cols[None, :], mask=mask_n[:, None], other=0)  # weights never depend on the step before
    if MODE == 1 and not FIRST and GDC:
        gdc_wait()
    ready = -1
    acc = tl.zeros([BN, TW], tl.float32)
    for k0 in range(0, KW, TW):
        k_next = tl.minimum(k0 + TW, KW - TW)
        u_next = tl.load(w_rows + k_next + cols[None, :], mask=mask_n[:, None], other=0)
        if MODE == 2 and not FIRST:  # the producer's chunks up to the one that holds x[(k0 + TW - 1) * s]
            hi = ((k0 + TW - 1) * x_stride) // BN // PPC
            ready = _wait_chunks(flags_in, hi, ready, p_prev, miss_ptr, PPC, GDC)
        x = tl.load(x_ptr + (k0 + cols) * x_stride, cache_modifier=".cg")  # through the L2: written this step
        if MODE == 2 and not FIRST and not GDC:  # the interpreter shows a value only once its chunk was waited for
            x = tl.where((k0 + cols) * x_stride // BN // PPC <= ready, x, float("nan"))
        acc += u.to(tl.float32) * x[None, :]
        u = u_next
    if MODE == 2 and NORM and not FIRST:  # a norm's 1/rms needs every chunk of its input
        ready = _wait_chunks(flags_in, tl.cdiv(p_prev, PPC) - 1, ready, p_prev, miss_ptr, PPC, GDC)
    tl.store(y_ptr + rows, tl.sum(acc, 1) * scale, mask=mask_n)
    if MODE == 2:  # every thread's stores, then this program's count (release): the "last block" pattern
        tl.debug_barrier()
        tl.atomic_add(flags_out + pid // PPC, 1, sem="release", scope="gpu")


# a small chain of the same structure for the check (ragged last programs, several chunks a tile)
SMALL = {"qkv": (384, 32), "attention": (128, 64), "o": (128, 32), "gate_up": (680, 32), "down": (128, 96)}


def build(layers: int, device: torch.device, stages: dict = STAGES) -> dict:
    """Weights (random 4-bit values in int32 words), one input and every stage's output and counters."""
    names = list(stages)
    shapes = list(stages.values())
    gen = torch.Generator(device=device).manual_seed(0)
    ws = [[torch.randint(0, 16, s, generator=gen, dtype=torch.int32, device=device) for s in shapes]
          for _ in range(layers)]
    x0 = torch.rand(shapes[-1][0], generator=gen, device=device)
    ys = [[torch.empty(n, dtype=torch.float32, device=device) for n, _ in shapes] for _ in range(layers)]
    flags = torch.zeros(layers * len(names) + 1, 4096, dtype=torch.int32, device=device)  # the last: waits missed
    return dict(names=names, shapes=shapes, ws=ws, x0=x0, ys=ys, flags=flags)


def run_chain(b: dict, mode: int, bn: int, tw: int, warps: int, ppc: int) -> None:
    """One decode step of the chain: every layer's five stages, each fed by the one before."""
    b["flags"].zero_()
    gpu = b["x0"].is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    x, p_prev, n_prev, f_prev = b["x0"], 1, b["x0"].numel(), None
    i = 0
    for layer in range(len(b["ws"])):
        for s, name in enumerate(b["names"]):
            n, kw = b["shapes"][s]
            first = layer == 0 and s == 0
            progs = triton.cdiv(n, bn)
            assert kw % tw == 0 and n_prev // kw >= 1 and triton.cdiv(progs, ppc) <= b["flags"].shape[1]
            f_out = b["flags"][i]
            launch = {"launch_pdl": True} if mode != 0 and not first and gpu else {}
            f_in = f_out if f_prev is None else f_prev  # the first stage waits for nothing
            _stage_kernel[(progs,)](b["ws"][layer][s], x, b["ys"][layer][s], f_in, f_out, b["flags"][-1], n, kw,
                                    n_prev // kw, p_prev, 1.0 / (7.5 * kw), BN=bn, TW=tw, PPC=ppc, MODE=mode,
                                    FIRST=first, NORM=name in NORM_AFTER, GDC=gpu, num_warps=warps, **launch)
            x, p_prev, n_prev, f_prev = b["ys"][layer][s], progs, n, f_out
            i += 1


def outputs(b: dict) -> torch.Tensor:
    return torch.cat([y for ys in b["ys"] for y in ys])


def check(device: torch.device) -> None:
    """Every checked mode's outputs equal the plain launches' bit for bit, on a chain of two small layers."""
    b = build(2, device, SMALL)
    ref = None
    for name, mode in MODES.items():
        if mode == 3:
            continue
        for y in (y for ys in b["ys"] for y in ys):
            y.fill_(float("nan"))
        run_chain(b, mode, 16, 16, 2, 2)
        got = outputs(b).cpu()
        assert int(b["flags"][-1, 0]) == 0, f"{name}: a consumer waited for a count its producer never reaches"
        assert torch.isfinite(got).all(), name
        if ref is None:
            ref = got
        assert torch.equal(got, ref), f"{name}: outputs differ from the plain launches'"
        print(f"{name}: outputs equal the plain launches' ({got.numel()} values)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10, help="graph replays timed")
    ap.add_argument("--layers", type=int, default=32, help="layers in the chain")
    ap.add_argument("--check", action="store_true", help="compare the modes' outputs only (the CPU interpreter)")
    args = ap.parse_args()
    if args.check or os.environ.get("TRITON_INTERPRET") == "1":
        check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return
    from gemv_chain_bench import time_graph  # this script's folder is first on sys.path when it runs

    dev = torch.device("cuda")
    check(dev)
    b = build(args.layers, dev)
    total = sum(n * k * 4 for n, k in b["shapes"])
    print(f"{torch.cuda.get_device_name()}: a layer {total / 1e6:.1f} MB of words in five stages")
    ref = None
    for name, mode in MODES.items():
        res = []
        for bn, tw, warps in ((16, 64, 2), (8, 128, 4), (32, 64, 4)):
            for ppc in ((8, 32) if mode == 2 else (8,)):
                ms = time_graph(lambda: run_chain(b, mode, bn, tw, warps, ppc), args.reps)
                res.append((ms, bn, tw, warps, ppc))
        res.sort()
        ms, bn, tw, warps, ppc = res[0]
        us = ms * 1e3 / args.layers
        extra = f", {ppc} programs a counter" if mode == 2 else ""
        print(f"{name:13s} {us:7.2f} us a layer ({total / us / 1e3:5.0f} GB/s; best of {len(res)}: {bn} rows x {tw} "
              f"words, {warps} warps{extra}); all: " + ", ".join(f"{r[0] * 1e3 / args.layers:.2f}" for r in res),
              flush=True)
        if mode != 3:  # the same tiles give the same bits in every mode that keeps the dependency
            run_chain(b, mode, 16, 64, 2, 8)
            got = outputs(b)
            ref = got if ref is None else ref
            assert torch.equal(got, ref), f"{name}: outputs differ from the plain launches'"


if __name__ == "__main__":
    main()
