"""Static instruction counts of the word GEMV's candidates for Hopper, no GPU needed.

Compiles ``rooflm.kernels.quant_gemv._quant_gemv_kernel`` for sm_90 with Triton's own toolchain (ptxas, then
nvdisasm and cuobjdump from Triton's NVIDIA backend), finds the main loop (the longest backward branch of the
SASS) and prints, for every candidate ``pick_gemv`` would time on Llama-2-7B's qkv and down projections at 4 and 8
bits: registers a thread, instructions in one iteration of the main loop, the same a word of codes (a thread's
share of the tile), and the loop's instruction mix. A diagnostic for kernel changes made without a GPU: fewer
instructions a word and fewer registers are necessary, not sufficient, for a faster kernel (the GPU decides).

    PYTHONPATH=src python3 tests/kernels/quant_gemv_sass.py [--mix] [--shapes qkv4,down4,qkv8,down8]
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rooflm.kernels import quant_gemv as qg

SHAPES = {"qkv4": (12288, 4096, 4, 128, True), "down4": (4096, 11008, 4, 128, True),
          "qkv8": (12288, 4096, 8, 4096, False), "down8": (4096, 11008, 8, 11008, False)}  # N, K, bits, group, mins
# the word GEMV's pointer and float arguments (the others are int32 or compile-time constants)
GEMV_TYPES = {**{n: "*fp16" for n in ("x_ptr", "s_ptr", "m_ptr", "b_ptr", "out_ptr")}, "xw_ptr": "*i32",
              "q_ptr": "*i32", "eps": "fp32"}


def compile_sm90(fn, constants: dict, types: dict, num_warps: int):
    """``fn`` compiled for sm_90: ``constants`` the compile-time arguments, ``types`` the others' (int32 if absent)."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def disassemble(kernel) -> tuple[list[str], int]:
    """The kernel's SASS instructions and its registers a thread."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", "-g", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    labels, ins = {}, []
    for line in text.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            ins.append(m.group(1))
    ins_loops = [(labels[m.group(1)], i + 1) for i, s in enumerate(ins)
                 if (m := re.search(r"BRA.*?(\.L_x_\d+)", s)) and labels.get(m.group(1), i + 1) <= i]
    lo, hi = max(ins_loops, key=lambda ab: ab[1] - ab[0], default=(0, 0))
    return ins[lo:hi], int(re.search(r"REG:(\d+)", res).group(1))


def opcode(instr: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instr.strip()).split()[0].split(".")[0]


def report(shapes: list[str], mix: bool) -> None:
    fn = qg._quant_gemv_kernel
    constexprs = {n for n, p in inspect.signature(fn.fn).parameters.items() if "constexpr" in str(p.annotation)}
    for name in shapes:
        n, k, bits, group, mins = SHAPES[name]
        per = 32 // bits
        for cfg in qg.gemv_candidates(n, k, bits, group, 132, wide=False):
            if cfg is None:  # the general kernel (rooflm/kernels/quant_gemm.py)
                continue
            shape = qg.tile_groups(cfg.words, k, bits, group)
            cons = dict(BITS=bits, HAS_MIN=mins, HAS_BIAS=False, SPLIT=cfg.split_k, EVEN_N=n % cfg.block_n == 0,
                        EVEN_K=k % (cfg.words * per) == 0, BLOCK_N=cfg.block_n, GROUPS=shape[0],
                        GROUP_WORDS=shape[1], ASM=True, PREFETCH=int(cfg.prefetch), PAIR=cfg.pair and shape[1] >= 2,
                        SILU_MUL=False, ADD_SUMSQ=False, RSTD=False, SS_BLOCK=1, TRIGGER=0, WAIT=False,
                        PRELOAD=False, L2_AHEAD=cfg.l2_ahead, r_ptr=None, nw_ptr=None, ro_ptr=None, ss_ptr=None)
            for arg, value in (("GROUP", group), ("stride_qn", k // per), ("stride_sn", k // group)):
                if arg in constexprs:  # compile-time constants in this source tree
                    cons[arg] = value
            loop, regs = disassemble(compile_sm90(fn, cons, GEMV_TYPES, cfg.num_warps))
            words = cfg.block_n * cfg.words / (32 * cfg.num_warps)  # a thread's words of a tile
            print(f"{name:6s} {qg.short_name(cfg):22s} registers {regs:3d}, main loop {len(loop):4d} instructions, "
                  f"{len(loop) / words:5.1f} a word", flush=True)
            if mix:
                counts = collections.Counter(opcode(s) for s in loop)
                print("       " + ", ".join(f"{op} {c}" for op, c in counts.most_common()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"a comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--mix", action="store_true", help="also print each main loop's instruction mix")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"--shapes {','.join(bad)}: expected names from {', '.join(SHAPES)}")
    report(shapes, args.mix)


if __name__ == "__main__":
    main()
