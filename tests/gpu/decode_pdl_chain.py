"""Which kernel boundaries of a one-row decode step gain from programmatic dependent launch (Hopper GPUs)?

Builds Llama-2-7B's 32 layers at one row and a 1k-token context (random float16 weights and caches, 12.9 GB of
weights): qkv GEMV -> decode attention (the step's token rotated and written by the kernel) -> o GEMV -> gate_up GEMV
-> down GEMV, each GEMV reading the previous output, captures the chain in one CUDA graph and times its replays
(three rounds, variants alternated). A boundary "with PDL" launches the second kernel with programmatic dependent
launch (it waits in place for the first, ``griddepcontrol.wait``) and lets the first trigger it as soon as all of its
programs have started. "o_proj preloading" launches o_proj so that it loads its first weight tile before it waits
(``launch_gemv(pdl_preload=True)``), with the wider tile of ``preload_config``. Every variant's outputs are checked bit
for bit against the plain launches of the same tiles first. (The engine now launches every boundary so, each GEMV
letting the next kernel in after its main loop, with the handoff kernels: ``tests/gpu/handoff_chain_sweep.py``.)

    PYTHONPATH=src python3 tests/gpu/decode_pdl_chain.py
"""
from __future__ import annotations

import torch

from rooflm.kernels import gemv as G
from rooflm.kernels.bench import decode_step_inputs, graph_ms
from rooflm.kernels.decode_attention import NewTokenKV, paged_decode_attention
from rooflm.kernels.handoff_gemv import preload_config

BOUNDARIES = ("qkv->attention", "attention->o", "o->gate_up", "gate_up->down", "down->qkv")
VARIANTS = {
    "plain launches": (),
    "attention launched so, qkv not triggering": ("attention-only",),
    "qkv->attention": ("qkv->attention",),
    "+ attention->o": ("qkv->attention", "attention->o"),
    "+ o->gate_up": ("qkv->attention", "attention->o", "o->gate_up"),
    "+ gate_up->down": ("qkv->attention", "attention->o", "o->gate_up", "gate_up->down"),
    "+ down->qkv": ("qkv->attention", "attention->o", "o->gate_up", "down->qkv"),
    "every boundary": BOUNDARIES,
    "o_proj's wide tile": ("qkv->attention", "attention->o", "o->gate_up", "wide"),
    "o_proj preloading its wide tile": ("qkv->attention", "attention->o", "o->gate_up", "wide", "preload"),
}


def main() -> None:
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.float16
    H, I, L = 4096, 11008, 32
    caches, tables, seq_lens, _, new = decode_step_inputs(1, 32, 32, 1024, dt, L)
    shapes = {"qkv": (3 * H, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
    layers = [{k: torch.randn(n, kk, dtype=dt, device=dev) * kk ** -0.5 for k, (n, kk) in shapes.items()}
              for _ in range(L)]
    x0 = torch.randn(1, H, dtype=dt, device=dev)
    cfgs = {}
    for k, w in layers[0].items():  # the tuned tile of each shape (a GEMV tile where torch's would win)
        c = G.choose(torch.randn(1, w.shape[1], dtype=dt, device=dev), w, None)
        cfgs[k] = c if isinstance(c, G.GemvConfig) else G.CANDIDATES[0]
    print("tiles:", {k: G._short(c) for k, c in cfgs.items()},
          "o_proj's wide tile:", G._short(preload_config(cfgs["o"], H)))

    def chain(on: tuple[str, ...]):
        b = {n: n in on for n in BOUNDARIES}
        o_cfg = preload_config(cfgs["o"], H) if "wide" in on else cfgs["o"]
        attn_pdl = b["qkv->attention"] or "attention-only" in on

        def run():
            x, outs = x0, []
            for w, cache in zip(layers, caches):
                qkv = G.launch_gemv(x, H, w["qkv"], None, cfgs["qkv"], pdl_trigger=b["qkv->attention"],
                                    pdl_wait=b["down->qkv"])
                q, k, v = (t.view(1, 32, 128) for t in qkv.split([H, H, H], dim=-1))
                a = paged_decode_attention(q, cache, tables, seq_lens, 128 ** -0.5, out=torch.empty_like(q),
                                           pdl=attn_pdl, new_kv=NewTokenKV(k, v, new.cos, new.sin, new.slot_mapping))
                o = G.launch_gemv(a.view(1, H), H, w["o"], None, o_cfg, pdl_wait=b["attention->o"],
                                  pdl_trigger=b["o->gate_up"], pdl_preload="preload" in on)
                gu = G.launch_gemv(o, H, w["gate_up"], None, cfgs["gate_up"], pdl_wait=b["o->gate_up"],
                                   pdl_trigger=b["gate_up->down"])
                x = G.launch_gemv(gu[:, :I], I, w["down"], None, cfgs["down"], pdl_wait=b["gate_up->down"],
                                  pdl_trigger=b["down->qkv"])
                outs.append(a)
            return [x] + outs
        return run

    refs = {tile: [t.clone() for t in chain(tile)()] for tile in ((), ("wide",))}
    for name, on in VARIANTS.items():
        ref = refs[("wide",) if "wide" in on else ()]
        same = all(torch.equal(a, b) for a, b in zip(chain(on)(), ref))
        assert same, f"{name}: outputs differ from the plain launches"
    times = {name: [] for name in VARIANTS}
    for _ in range(3):
        for name, on in VARIANTS.items():
            times[name].append(graph_ms([chain(on)], reps=10))
    base = min(times["plain launches"])
    print(f"{'variant':44s} {'ms per chain (3 rounds)':>26s} {'best':>7s} {'saved':>7s}")
    for name, ts in times.items():
        print(f"{name:44s} {' '.join(f'{t:.4f}' for t in ts):>26s} {min(ts):7.4f} {base - min(ts):7.4f}")


if __name__ == "__main__":
    main()
