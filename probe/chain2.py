"""The engine's one-row decode launches for Llama-2-7B's 32 layers (handed-over norms, PDL as llama.py), one CUDA
graph; sweep each projection's tile with the others at the engine's pick."""
import sys
import torch
from rooflm.kernels import handoff_gemv as hg
from rooflm.kernels.gemv import GemvConfig, _short
from rooflm.kernels._utils import TRIGGER_LATE as LATE, TRIGGER_START as START
from rooflm.kernels.bench import decode_step_inputs, graph_ms
from rooflm.kernels.decode_attention import NewTokenKV, paged_decode_attention

torch.manual_seed(0)
dev, dt = torch.device("cuda"), torch.float16
H, I, L = 4096, 11008, 32
caches, tables, seq_lens, _, new = decode_step_inputs(1, 32, 32, 1024, dt, L)
shapes = {"qkv": (3 * H, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
layers = [{k: torch.randn(n, kk, dtype=dt, device=dev) * kk ** -0.5 for k, (n, kk) in shapes.items()} for _ in range(L)]
nw = [1 + 0.1 * torch.randn(H, dtype=dt, device=dev) for _ in range(2 * L + 1)]
x = torch.randn(1, H, dtype=dt, device=dev)
o_cfg, gu_cfg = hg.pick_handoff(x, layers[0]["o"], None, layers[0]["gate_up"], None, 1e-5, True)
d_cfg, q_cfg = hg.pick_handoff(torch.randn(1, I, dtype=dt, device=dev), layers[0]["down"], None, layers[0]["qkv"], None, 1e-5, False)
pick = {"qkv": q_cfg, "o": o_cfg, "gate_up": gu_cfg, "down": d_cfg}
print("engine picks:", {k: _short(v) for k, v in pick.items()}, flush=True)
y0 = torch.randn(1, H, dtype=dt, device=dev)
ss0 = torch.rand(256, device=dev) * 16
res0 = torch.randn(1, H, dtype=dt, device=dev)


def chain(cfg):
    def run():
        y, ss, res = y0, ss0, res0
        for i, (w, cache) in enumerate(zip(layers, caches)):
            qkv = hg.rmsnorm_sumsq_gemv(y, ss, 1e-5, w["qkv"], None, cfg["qkv"], pdl_trigger=START, pdl_wait=i > 0,
                                        pdl_preload=i > 0)
            q, k, v = (t.view(1, 32, 128) for t in qkv.split([H, H, H], dim=-1))
            a = paged_decode_attention(q, cache, tables, seq_lens, 128 ** -0.5, out=torch.empty_like(q), pdl=True,
                                       new_kv=NewTokenKV(k, v, new.cos, new.sin, new.slot_mapping))
            yo, h, sso = hg.gemv_add_sumsq(a.view(1, H), w["o"], None, cfg["o"], res, nw[2 * i], pdl_wait=True,
                                           pdl_trigger=START, pdl_preload=True)
            gu = hg.rmsnorm_sumsq_gemv(yo, sso, 1e-5, w["gate_up"], None, cfg["gate_up"], silu_mul=True,
                                       pdl_wait=True, pdl_trigger=LATE, pdl_preload=True)
            y, res, ss = hg.gemv_add_sumsq(gu, w["down"], None, cfg["down"], h, nw[2 * i + 1], pdl_wait=True,
                                           pdl_trigger=LATE)
        return y
    return run


extra = [GemvConfig(False, 8, 256, 1, 4, 3), GemvConfig(False, 4, 256, 1, 4, 3), GemvConfig(False, 8, 256, 1, 4, 4),
         GemvConfig(False, 16, 256, 1, 8, 3), GemvConfig(False, 32, 128, 1, 4, 3), GemvConfig(False, 16, 128, 1, 4, 3),
         GemvConfig(False, 8, 512, 1, 4, 3), GemvConfig(False, 4, 1024, 1, 4, 2), GemvConfig(False, 32, 256, 1, 8, 3),
         GemvConfig(False, 16, 512, 1, 4, 2), GemvConfig(False, 16, 256, 1, 4, 3), GemvConfig(False, 8, 1024, 1, 4, 2),
         GemvConfig(False, 64, 128, 1, 8, 3), GemvConfig(False, 32, 256, 1, 8, 4)]
def parse(t):  # 4x1024w4s2
    a, rest = t.split("x")
    b, rest = rest.split("w")
    w, st = rest.split("s")
    return GemvConfig(False, int(a), int(b), 1, int(w), int(st))


which = []
for arg in sys.argv[1:]:
    if "=" in arg:
        k, v = arg.split("=")
        pick[k] = parse(v)
    else:
        which.append(arg)
SWEEP = {"gate_up": "4x1024w4s2 4x2048w4s2 2x2048w4s2 4x1024w2s2 8x1024w4s2 4x512w4s3 2x1024w4s2 4x1024w4s3 8x512w4s3 4x1024w8s2 16x256w4s3",
         "o": "4x256w4s3 8x1024w4s2 2x2048w4s2 4x512w4s3 2x1024w4s2 4x1024w4s2",
         "down": "4x1024w4s2 8x512w4s3 4x512w4s3 2x1024w4s2 16x512w4s2 4x2048w4s2",
         "qkv": "16x256w4s3 8x1024w4s2 4x1024w4s2 8x512w4s3 32x128w4s3 32x256w8s3"}
print("base:", {k: _short(v) for k, v in pick.items()}, flush=True)
base = graph_ms([chain(pick)], reps=10)
print(f"base: {base:.4f} ms", flush=True)
for name in which:
    res = []
    for c in [parse(t) for t in SWEEP[name].split()]:
        if c == pick[name] or (name == "gate_up" and c.block_n < 2):
            continue
        cfg = dict(pick, **{name: c})
        try:
            t = graph_ms([chain(cfg)], reps=10)
        except Exception as e:  # noqa: BLE001
            print(name, _short(c), "failed", type(e).__name__, str(e)[:100], flush=True)
            continue
        res.append((t, _short(c), c.num_stages))
    b2 = graph_ms([chain(pick)], reps=10)
    res.sort()
    print(f"{name}: base {_short(pick[name])} {b2:.4f} ms; " + ", ".join(f"{n}p{c} {t:.4f}" for t, n, c in res), flush=True)
