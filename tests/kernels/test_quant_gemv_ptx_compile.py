"""The word GEMV's float16x2 PTX form compiles for Hopper (sm_90) in every loop shape it can be launched with.

On the CPU the kernel tests run Triton's interpreter, which takes the float32 form and never reaches the inline PTX
(rooflm/kernels/quant_gemv_ptx.py), the prefetching loops' GPU lowering or the L2 requests (CUDA only); this compiles
them ahead of time with Triton's own ptxas, no GPU needed, so an error there fails on every machine, not only on one
with a GPU. Run in a subprocess: the interpreter, once on, applies to every @triton.jit function of the process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import itertools
from quant_gemv_sass import GEMV_TYPES, compile_sm90  # tests/kernels, on the subprocess's PYTHONPATH
from rooflm.kernels.quant_gemv import _quant_gemv_kernel as fn

done = 0
for bits, prefetch, pair, even_k, has_min, l2 in itertools.product((4, 8), (0, 1, 2), (False, True), (True, False),
                                                                   (False, True), (0, 3)):
    if l2 and not even_k:  # the L2 requests with every prefetch depth, pair and mins, K whole tiles
        continue
    group = 128 if bits == 4 else 4096  # K = 4096: the row stride in words, the scales' in groups
    cons = dict(GROUP=group, stride_qn=4096 * bits // 32, stride_sn=4096 // group, BITS=bits, HAS_MIN=has_min,
                HAS_BIAS=True, SPLIT=1, EVEN_N=False, EVEN_K=even_k, BLOCK_N=16, GROUPS=1 if bits == 8 else 4,
                GROUP_WORDS=64 if bits == 8 else 16, ASM=True, PREFETCH=prefetch,
                PAIR=pair, SILU_MUL=l2 and has_min, ADD_SUMSQ=False, RSTD=False, SS_BLOCK=1, TRIGGER=0, WAIT=False,
                PRELOAD=False, L2_AHEAD=l2, r_ptr=None, nw_ptr=None, ro_ptr=None, ss_ptr=None)
    ptx = compile_sm90(fn, cons, GEMV_TYPES, 2).asm["ptx"]
    what = f"bits={bits} prefetch={prefetch} pair={pair} even_k={even_k} mins={has_min} l2_ahead={l2}"
    assert "fma.rn.f16x2" in ptx, f"{what}: no float16x2 products in the PTX"
    assert "lop3.b32" in ptx or bits == 8, f"{what}: no nibble extraction in the PTX"
    assert ("prefetch.global.L2" in ptx) == bool(l2), f"{what}: L2 requests where none were asked for, or none"
    done += 1
print("compiled", done)
"""


def test_word_gemv_ptx_form_compiles_for_sm90() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root / "tests" / "kernels"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled 72" in run.stdout, run.stdout


def test_sass_report_finds_each_candidates_products_loop() -> None:
    """tests/kernels/quant_gemv_sass.py (the static counts quoted in rooflm/kernels/quant_gemv.py) finds, for every
    8-bit candidate of a qkv projection, a main loop that holds the float16x2 products."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src") + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, str(root / "tests" / "kernels" / "quant_gemv_sass.py"), "--shapes", "qkv8",
                          "--mix"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    counts, mixes = lines[0::2], lines[1::2]
    assert len(counts) == len(mixes) >= 4, run.stdout
    for count, mix in zip(counts, mixes):
        loop = int(count.split("main loop")[1].split()[0])
        assert 100 < loop < 2000 and "HFMA2" in mix and "LDG" in mix, (count, mix)
