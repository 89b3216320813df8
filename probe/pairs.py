"""pick_handoff's pair timing with and without the engine's PDL launches: which (producer, consumer) tiles win."""
import torch
from rooflm.kernels import handoff_gemv as hg
from rooflm.kernels.gemv import _short
from rooflm.kernels._utils import TRIGGER_LATE as LATE, TRIGGER_START as START, time_in_graph, weight_copies

dev, dt = torch.device("cuda"), torch.float16
H, I = 4096, 11008
cfgs = hg._row_configs()
for name, (pn, pk), (cn, ck), silu in (("o->gate_up", (H, H), (2 * I, H), True), ("down->qkv", (H, I), (3 * H, H), False)):
    P = torch.randn(pn, pk, dtype=dt, device=dev) * pk ** -0.5
    C = torch.randn(cn, ck, dtype=dt, device=dev) * ck ** -0.5
    pairs = list(zip(weight_copies(P), weight_copies(C)))
    xs = torch.randn(1, pk, dtype=dt, device=dev)
    res = torch.randn(1, pn, dtype=dt, device=dev)
    nw = torch.ones(pn, dtype=dt, device=dev)
    pt, ct = (START, LATE) if silu else (LATE, START)

    def fused(v, w, pdl):
        y, _, ss = hg.gemv_add_sumsq(xs, w[0], None, v[0], res, nw, pdl_wait=pdl, pdl_trigger=pt if pdl else 0,
                                     pdl_preload=pdl and silu)
        return hg.rmsnorm_sumsq_gemv(y, ss, 1e-5, w[1], None, v[1], silu, pdl_trigger=ct if pdl else 0,
                                     pdl_wait=pdl, pdl_preload=pdl)
    for pdl in (False, True):
        for rep in range(2):
            r = sorted((time_in_graph(lambda w, v=(p, c): fused(v, w, pdl), pairs, dev), p, c)
                       for p in cfgs for c in cfgs if not silu or c.block_n >= 2)
            print(name, "pdl" if pdl else "plain", rep, " | ".join(f"{_short(p)}/{_short(c)} {t*1e3:.2f}" for t, p, c in r[:6]), flush=True)
