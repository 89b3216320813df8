"""llama.cpp as a baseline for ``rooflm bench latency --baseline llama.cpp``: the same GGUF file, the same prompt
token ids, the same number of threads, timed the same way (TTFT = the prompt's prefill and first token; TPOT = the
rest of the decode divided by output_len - 1; greedy, end of sequence ignored).

llama.cpp runs through the ``llama-cpp-python`` package in a child process, for two reasons: its OpenMP threads and
torch's must not compete inside one process, and a crash inside the native library must not take the benchmark
down. Some builds crash while repacking weights for the CPU's matrix extensions (AMX, seen with
llama-cpp-python 0.3.36 on a Sapphire Rapids virtual machine); when the child dies of a signal, it is run once more
with llama.cpp's extra (repacking) buffer types off, and the result says so.

Install: ``pip install llama-cpp-python`` (it builds llama.cpp from source: about 5 minutes on 2 cores), or
``make llama-cpp``.

Run directly (what the parent does): ``python -m rooflm.bench.llamacpp --model F.gguf --prompts ids.json
--output-len 64 --threads 2`` prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

INSTALL_HINT = ("--baseline llama.cpp needs the llama-cpp-python package: `pip install llama-cpp-python` (builds "
                "llama.cpp from source, about 5 minutes on 2 cores) or `make llama-cpp`")


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def run_baseline(model_path: str, prompts: list[list[int]], output_len: int, threads: int,
                 timeout_s: float = 1800) -> dict:
    """Time llama.cpp on ``prompts`` (one after another: llama-cpp-python runs one sequence) in a child process.
    Returns medians over the prompts: ttft_s, tpot_s, e2e_s, decode_tok_s, e2e_tok_s, plus tokens of the first
    prompt, the llama-cpp-python version and whether the repacking buffers were off."""
    if not available():
        raise RuntimeError(INSTALL_HINT)
    if not model_path.endswith(".gguf"):
        raise ValueError(f"--baseline llama.cpp needs a .gguf model, got --model {model_path!r}")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
        prompt_file = f.name
    try:
        for no_repack in (False, True):
            cmd = [sys.executable, "-m", "rooflm.bench.llamacpp", "--model", model_path, "--prompts", prompt_file,
                   "--output-len", str(output_len), "--threads", str(threads)] + (["--no-repack"] if no_repack else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            if proc.returncode == 0:
                return json.loads(proc.stdout.strip().splitlines()[-1])
            if proc.returncode >= 0:  # an error, not a crash: retrying would not help
                break
        raise RuntimeError(f"llama.cpp baseline failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    finally:
        os.unlink(prompt_file)


def _load(model_path: str, threads: int, no_repack: bool, n_ctx: int):
    import llama_cpp

    if no_repack:  # llama_model_params.use_extra_bufts: the CPU repacking buffers (AMX, AArch64 layouts)
        default_params = llama_cpp.llama_model_default_params

        def params():
            p = default_params()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_cpp.llama_model_default_params = params
        llama_cpp.llama.llama_cpp.llama_model_default_params = params
    return llama_cpp.Llama(model_path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                           verbose=False, logits_all=False)


def _time_one(llm, prompt: list[int], output_len: int) -> dict:
    llm.reset()
    t0 = time.perf_counter()
    t_first = None
    tokens = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        tokens.append(int(tok))
        if t_first is None:
            t_first = time.perf_counter()
        if len(tokens) == output_len:
            break
    t_end = time.perf_counter()
    tpot = (t_end - t_first) / (output_len - 1) if output_len > 1 else float("nan")
    return {"ttft_s": t_first - t0, "tpot_s": tpot, "e2e_s": t_end - t0, "tokens": tokens}


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rooflm.bench.llamacpp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-repack", action="store_true", help="llama.cpp's extra (repacking) buffer types off")
    args = p.parse_args(argv)
    import statistics

    import llama_cpp

    with open(args.prompts) as f:
        prompts = json.load(f)
    n_ctx = max(len(x) for x in prompts) + args.output_len + 8
    llm = _load(args.model, args.threads, args.no_repack, n_ctx)
    _time_one(llm, prompts[0][:16], min(8, args.output_len))  # warm-up
    runs = [_time_one(llm, pr, args.output_len) for pr in prompts]
    med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "tpot_s", "e2e_s")}
    out = {**med, "decode_tok_s": 1 / med["tpot_s"], "e2e_tok_s": args.output_len / med["e2e_s"],
           "tokens": runs[0]["tokens"], "version": llama_cpp.__version__, "threads": args.threads,
           "repack_buffers": not args.no_repack, "runs": len(runs)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
