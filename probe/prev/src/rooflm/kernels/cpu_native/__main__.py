"""Benchmark of the native CPU quantized matmul against torch's int4 kernel (not a test: timings on a shared machine
are noisy; alternate A and B and keep the load average beside the figures).

``python -m rooflm.kernels.cpu_native [--model PATH] [--rows 1,2,5,8,16] [--threads 1,2] [--decode-pairs 3]``

1. Layer passes: the model's projection weights (every layer, so the weights come from memory, not cache, as in a
   decode step) multiplied once each, for M activation rows: milliseconds per pass over all layers, torch's
   kernels (``ROOFLM_CPU_NATIVE=off``'s form) vs native, and the LM head alone.
2. Decode: ``LLM.generate`` greedy decode tokens per second of the model with torch's kernels and with the native
   kernel, alternating, several pairs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as f:
            return "load average " + " ".join(f.read().split()[:3])
    except OSError:
        return "load average n/a"


def _forms(model):
    """(name, torch form, native form) of every quantized projection of ``model``, in layer order."""
    from rooflm.kernels.cpu_native import (
        default_flags,
        load_library,
        native_supports,
        pack_native,
    )
    from rooflm.kernels.cpu_quant import prepare_cpu
    from rooflm.layers.linear import QuantizableMixin

    lib = load_library(default_flags())
    old = os.environ.get("ROOFLM_CPU_NATIVE")
    os.environ["ROOFLM_CPU_NATIVE"] = "off"
    try:
        out = []
        for name, mod in model.named_modules():
            pw = mod.packed_weight if isinstance(mod, QuantizableMixin) else None
            if pw is not None and native_supports(pw):
                out.append((name, prepare_cpu(pw), pack_native(pw, lib)))
    finally:
        if old is None:
            del os.environ["ROOFLM_CPU_NATIVE"]
        else:
            os.environ["ROOFLM_CPU_NATIVE"] = old
    return out


def _pass_ms(weights, m: int, native: bool, repeats: int) -> float:
    from rooflm.kernels.cpu_native import native_linear
    from rooflm.kernels.cpu_quant import quant_linear_cpu

    xs = {k: torch.randn(m, k) for k in {nw.in_features for _, _, nw in weights}}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _, cw, nw in weights:
            if native:
                native_linear(xs[nw.in_features], nw)
            else:
                quant_linear_cpu(xs[nw.in_features], cw)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_layers(model_path: str | None, rows: list[int], threads: list[int], repeats: int) -> None:
    from rooflm.loader import load_model

    model, _ = load_model(model_path, show_progress=False)
    forms = _forms(model)
    layers = [f for f in forms if "lm_head" not in f[0]]
    head = [f for f in forms if "lm_head" in f[0]]
    print(f"{len(layers)} projections ({sum(f[2].nbytes for f in layers) / 1e6:.1f} MB native, "
          f"{sum(f[1].nbytes for f in layers) / 1e6:.1f} MB torch int4), LM head {len(head)}; {_uptime()}")
    saved = torch.get_num_threads()
    try:
        for th in threads:
            torch.set_num_threads(th)
            for m in rows:
                for label, group in (("layers", layers), ("lm_head", head)):
                    if not group:
                        continue
                    a = _pass_ms(group, m, False, repeats)
                    b = _pass_ms(group, m, True, repeats)
                    print(f"threads {th}  M {m:3d}  {label:8s} torch {a:7.2f} ms  native {b:7.2f} ms  "
                          f"speed-up {a / b:4.2f}x  ({_uptime()})", flush=True)
    finally:
        torch.set_num_threads(saved)


def bench_decode(model_path: str | None, pairs: int, tokens: int) -> None:
    from rooflm.llm import LLM
    from rooflm.sampling_params import SamplingParams

    llms = {}
    for mode in ("off", "on"):
        os.environ["ROOFLM_CPU_NATIVE"] = mode
        llms[mode] = LLM(model_path, show_progress=False)
    prompt = "The history of the printing press begins"
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)

    for llm in llms.values():  # warm up (first-call allocations, the thread pool)
        llm.generate([prompt], short, use_tqdm=False)

    def rate(llm) -> float:  # the prompt's prefill is one step of a few tokens: left in
        t0 = time.perf_counter()
        llm.generate([prompt], long, use_tqdm=False)
        return tokens / (time.perf_counter() - t0)

    for i in range(pairs):
        r = {mode: rate(llm) for mode, llm in llms.items()}
        print(f"pair {i + 1}: decode tok/s  torch {r['off']:6.1f}  native {r['on']:6.1f}  ratio "
              f"{r['on'] / r['off']:4.2f}  ({_uptime()})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rooflm.kernels.cpu_native", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF or checkpoint (default: the embedded SmolLM2-135M GGUF)")
    p.add_argument("--rows", default="1,2,5,8,16", help="activation rows M per product (default 1,2,5,8,16)")
    p.add_argument("--threads", default="1,2", help="torch thread counts to run with (default 1,2)")
    p.add_argument("--repeats", type=int, default=7, help="passes per figure; the median is printed (default 7)")
    p.add_argument("--decode-pairs", type=int, default=3, help="off/on decode pairs (default 3; 0 skips)")
    p.add_argument("--decode-tokens", type=int, default=64, help="decoded tokens per run (default 64)")
    p.add_argument("--skip-layers", action="store_true", help="only the decode A/B")
    args = p.parse_args(argv)
    from rooflm.kernels.cpu_native import default_flags, isa_name, load_library

    flags = default_flags()
    print(f"native kernel: {isa_name(load_library(flags))}, threads: {'OpenMP (torch)' if flags else 'own pool'}; "
          f"torch {torch.__version__}")
    if not args.skip_layers:
        bench_layers(args.model, [int(v) for v in args.rows.split(",")], [int(v) for v in args.threads.split(",")],
                     args.repeats)
    if args.decode_pairs > 0:
        bench_decode(args.model, args.decode_pairs, args.decode_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
