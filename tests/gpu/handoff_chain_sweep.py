"""Which tile should each handed-over projection of a one-row decode step take, measured in the step rather than alone?

Builds Llama-2-7B's 32 layers at one row and a 1k-token context (random float16 weights and caches, 12.9 GB of
weights) and launches them as the model does on a Hopper GPU (``rooflm/models/llama.py``): qkv_proj (the norm's
statistic handed over from the previous down_proj) -> decode attention (the step's token rotated and written by the
kernel) -> o_proj (residual add handed over) -> gate_up_proj (SiLU-and-mul epilogue) -> down_proj, every boundary with
programmatic dependent launch under the plans ``O_TO_GATE_UP`` and ``DOWN_TO_QKV``. The chain is captured in one CUDA
graph and replayed; then one projection's tile at a time is swapped for each tile of a list, the others kept at the
engine's picks (``pick_handoff`` under the same plans), and the chain timed again.

    PYTHONPATH=src python3 tests/gpu/handoff_chain_sweep.py [down qkv gate_up o] [gate_up=4x1024w4s2 ...]

A bare name sweeps that projection; ``name=BxKwWsS`` fixes its tile (B rows x K columns a tile, W warps, S stages)
before the sweep. docs/benchmarks.md has the figures that made ``pick_handoff`` time the pairs under their launches.
"""
from __future__ import annotations

import sys

import torch

from rooflm.kernels import handoff_gemv as hg
from rooflm.kernels._utils import DOWN_TO_QKV, O_TO_GATE_UP
from rooflm.kernels.bench import decode_step_inputs, graph_ms
from rooflm.kernels.decode_attention import NewTokenKV, paged_decode_attention
from rooflm.kernels.gemv import GemvConfig, _short

H, I, L, EPS = 4096, 11008, 32, 1e-5
SWEEP = {
    "gate_up": "4x1024w4s2 4x2048w4s2 2x2048w4s2 4x1024w2s2 8x1024w4s2 4x512w4s3 2x1024w4s2 4x1024w4s3 8x512w4s3 "
               "4x1024w8s2 16x256w4s3 32x256w8s3",
    "o": "4x256w4s3 8x1024w4s2 2x2048w4s2 4x512w4s3 2x1024w4s2 4x1024w4s2 8x512w4s3 16x512w4s2",
    "down": "4x1024w4s2 8x512w4s3 4x512w4s3 2x1024w4s2 16x512w4s2 4x2048w4s2",
    "qkv": "16x256w4s3 8x1024w4s2 4x1024w4s2 8x512w4s3 32x128w4s3 32x256w8s3",
}


def parse(tile: str) -> GemvConfig:
    """``4x1024w4s2`` -> a one-row GEMV tile of 4 rows x 1024 columns, 4 warps, 2 stages."""
    rows, rest = tile.split("x")
    cols, rest = rest.split("w")
    warps, stages = rest.split("s")
    return GemvConfig(False, int(rows), int(cols), 1, int(warps), int(stages))


def main(argv: list[str]) -> None:
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.float16
    caches, tables, seq_lens, _, new = decode_step_inputs(1, 32, 32, 1024, dt, L)
    shapes = {"qkv": (3 * H, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
    layers = [{k: torch.randn(n, kk, dtype=dt, device=dev) * kk ** -0.5 for k, (n, kk) in shapes.items()}
              for _ in range(L)]
    nw = [1 + 0.1 * torch.randn(H, dtype=dt, device=dev) for _ in range(2 * L)]
    w0 = layers[0]
    o_cfg, gu_cfg = hg.pick_handoff(torch.randn(1, H, dtype=dt, device=dev), w0["o"], None, w0["gate_up"], None, EPS,
                                    True, O_TO_GATE_UP)
    d_cfg, q_cfg = hg.pick_handoff(torch.randn(1, I, dtype=dt, device=dev), w0["down"], None, w0["qkv"], None, EPS,
                                   False, DOWN_TO_QKV)
    pick = {"qkv": q_cfg, "o": o_cfg, "gate_up": gu_cfg, "down": d_cfg}
    print("engine's picks:", {k: _short(v) for k, v in pick.items()}, flush=True)
    y0, res0 = torch.randn(1, H, dtype=dt, device=dev), torch.randn(1, H, dtype=dt, device=dev)
    ss0 = torch.rand(256, device=dev) * 16  # partial sums of squares as a previous down_proj leaves them

    def chain(cfg):
        def run():
            y, ss, res = y0, ss0, res0
            for i, (w, cache) in enumerate(zip(layers, caches)):
                launch = DOWN_TO_QKV.consumer() if i else {"pdl_trigger": DOWN_TO_QKV.consumer_trigger}
                qkv = hg.rmsnorm_sumsq_gemv(y, ss, EPS, w["qkv"], None, cfg["qkv"], **launch)
                q, k, v = (t.view(1, 32, 128) for t in qkv.split([H, H, H], dim=-1))
                a = paged_decode_attention(q, cache, tables, seq_lens, 128 ** -0.5, out=torch.empty_like(q), pdl=True,
                                           new_kv=NewTokenKV(k, v, new.cos, new.sin, new.slot_mapping))
                yo, h, sso = hg.gemv_add_sumsq(a.view(1, H), w["o"], None, cfg["o"], res, nw[2 * i],
                                               **O_TO_GATE_UP.producer())
                gu = hg.rmsnorm_sumsq_gemv(yo, sso, EPS, w["gate_up"], None, cfg["gate_up"], silu_mul=True,
                                           **O_TO_GATE_UP.consumer())
                y, res, ss = hg.gemv_add_sumsq(gu, w["down"], None, cfg["down"], h, nw[2 * i + 1],
                                               **DOWN_TO_QKV.producer())
            return y
        return run

    which = []
    for arg in argv:
        if "=" in arg:
            name, tile = arg.split("=")
            pick[name] = parse(tile)
        else:
            which.append(arg)
    print(f"chain with {', '.join(f'{k} {_short(v)}' for k, v in pick.items())}: "
          f"{graph_ms([chain(pick)], reps=10):.4f} ms", flush=True)
    for name in which or ["down", "qkv", "gate_up", "o"]:
        times = []
        for cfg in (parse(t) for t in SWEEP[name].split()):
            if cfg != pick[name]:
                times.append((graph_ms([chain(dict(pick, **{name: cfg}))], reps=10), cfg))
        base = graph_ms([chain(pick)], reps=10)  # again, after the sweep: the card's drift
        times.sort(key=lambda r: r[0])
        print(f"{name}: {_short(pick[name])} {base:.4f} ms; "
              + ", ".join(f"{_short(c)}s{c.num_stages} {t:.4f}" for t, c in times), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
