"""Command-line options generated from the config dataclasses, so the CLI and the Python API never drift apart."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import typing

_HELP = {
    "model": "a GGUF file, a Hugging Face checkpoint folder or a named config (default: embedded SmolLM2-135M-Instruct)",
    "load_format": "auto | safetensors | gguf | dummy (random weights from the config)",
    "dtype": "auto (float32 on the CPU, bfloat16 on CUDA) | float32 | float16 | bfloat16",
    "device": "auto (cuda when available) | cpu | cuda | cuda:N",
    "tokenizer": "tokenizer folder or file (default: the model's own)",
    "max_model_len": "longest prompt + output in tokens (default: the model's max positions, at most 2048 on the CPU "
                     "and 8192 on CUDA)",
    "kv_cache_memory": "bytes for the KV-cache pool, suffixes K, M, G accepted (default: 512M on the CPU; on CUDA "
                       "what --gpu-memory-utilization leaves after the weights and the activation peak)",
    "kv_cache_dtype": "auto (the model's dtype) | int8 | fp8: a quantized KV cache holds about twice the tokens",
    "block_size": "tokens per KV-cache block (the paging granularity)",
    "max_num_batched_tokens": "token budget of one engine step (chunked prefill)",
    "max_num_seqs": "sequences decoded together at most",
    "enable_prefix_caching": "reuse the KV blocks of a prompt prefix seen before",
    "num_gpu_blocks_override": "use exactly this many KV-cache blocks (default: sized from the memory)",
    "seed": "seed of random weights and of requests without their own seed",
    "enforce_eager": "no CUDA graphs (every step launches its kernels one by one)",
    "attention_backend": "auto (follows --ops) | torch (reference) | triton | cpu",
    "ops": "auto | native | triton | cpu: which implementation each operator uses",
    "show_progress": "show a progress bar while the weights load",
    "async_scheduling": "schedule step N+1 while step N runs on the GPU (default: on for CUDA, off on the CPU); with "
                        "speculative decoding only the steps in which speculation is switched off overlap",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and the KV pool",
    "speculative_config": "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                          "(default: off)",
    "scheduling_policy": "fcfs | priority | mlfq | fair: admission and preemption order (docs/scheduling.md)",
    "mlfq_num_levels": "mlfq: number of priority levels",
    "mlfq_quantum": "mlfq: generated tokens of the top level's quantum (doubling per level)",
    "mlfq_skip_join_tokens": "mlfq: the longest prompt that joins the top level (one level lower per doubling)",
    "mlfq_starvation_steps": "mlfq: scheduler steps a waiting request waits before it is promoted to the top level",
    "fair_input_weight": "fair: cost of one prompt token in the virtual token counter",
    "fair_output_weight": "fair: cost of one generated token in the virtual token counter",
    "priority_prefill_chunk": "priority: most prompt tokens per step of the requests below the best priority seen "
                              "together (bounds the step a high-priority arrival waits for); auto: as many as a "
                              "step computes in about two decode steps' time on this machine's roofline; 0: no limit",
    "tensor_parallel_size": "split the model over this many processes: GPUs 0..N-1 (NCCL) or CPU processes (gloo)",
    "pipeline_parallel_size": "split the decoder layers into this many stages; with -tp, each stage is a "
                              "tensor-parallel group (tp x pp processes, one GPU each)",
    "enable_expert_parallel": "mixture-of-experts models: each of the -tp ranks holds whole experts (num_experts / "
                              "tp of them) instead of a slice of every expert; attention stays tensor-parallel",
    "preemption_mode": "recompute | swap | auto: what happens to a preempted request's KV (auto: swap when the "
                       "roofline's time to recompute its context exceeds the host transfer time)",
    "swap_space": "GiB of host memory for swapped-out KV blocks (preemption_mode swap or auto)",
    "kv_offload_gb": "GiB of host memory for the prefix cache's host tier: cached KV blocks evicted from the device "
                     "are kept there and copied back on a later prefix hit instead of recomputed (0: off)",
    "kv_compression": "lossy KV compression as JSON, e.g. '{\"method\": \"streaming\", \"budget\": 1024, "
                      "\"sink\": 4}' (StreamingLLM: sink tokens and the most recent window, whole blocks)",
    "ttft_slo_ms": "refuse at once (503) a request whose predicted time to first token exceeds this many ms",
    # rooflm.quantization.config.QUANTIZATION_METHODS, written out so that --help does not import torch
    "quantization": "none | w8a16 | w4a16 | gptq | awq | gguf | fp8: how the projection weights are stored and "
                    "multiplied (default: what the checkpoint holds: float, GPTQ/AWQ, a GGUF file kept quantized)",
    "cpu_offload_gb": "GiB of the decoder layers' weights kept in host memory and streamed to the device one layer "
                      "ahead of the compute (runs a model larger than the device; no CUDA graphs)",
    "data_parallel_size": "engine replicas behind the server, each with its own weights and KV cache (on CUDA one "
                          "per device); requests go to the least loaded, or to the one caching their prefix",
}


def parse_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 536870912, 512M, 2G)") from None


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


# vLLM's short spellings of some engine flags
_SHORT = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp"}


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = {int: int, float: float, str: str, bool: _bool}.get(base, str)
        if f.name == "kv_cache_memory":
            kind = parse_bytes
        elif f.name == "priority_prefill_chunk":
            kind = _int_or_auto
        help_text = _HELP.get(f.name, "")  # a field without help fails the CLI's help test
        if default is not None and "default" not in help_text:
            help_text += f" (default: {default})"
        if base is bool:
            parser.add_argument(flag, type=_bool, nargs="?", const=True, default=default, help=help_text)
            # vLLM's negation: --no-enable-prefix-caching is --enable-prefix-caching false
            parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_const", const=False,
                                help=f"same as {flag} false")
        else:
            short = (_SHORT[f.name],) if f.name in _SHORT else ()
            parser.add_argument(*short, flag, type=kind, default=default, help=help_text)


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'auto'") from None


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: taskset, cgroup cpusets), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _threads(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of threads (an integer >= 1)")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from rooflm.config import EngineConfig

    add_dataclass_args(parser, EngineConfig)
    parser.add_argument("--threads", type=_threads, default=None,
                        help="CPU compute threads (default: the CPUs this process may use, "
                             f"{available_cpus()} here, or 1 when a quick probe finds the machine busy)")


def set_compute_threads(threads: int | None) -> int:
    """Size torch's intra-op pool: ``threads``, or the CPUs this process may use, probed (``probe_threads``) so
    that a machine already busy gets fewer. torch's own default counts the machine's cores, which oversubscribes a
    process confined to fewer (a container, taskset) and makes the threads wait on each other at every operator."""
    import torch

    n = threads or probe_threads(available_cpus())
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def pick_threads(seconds: dict[int, float], margin: float = 1.0) -> int:
    """The thread count to use from probe times {threads: seconds}: the most threads, unless fewer are faster (by
    ``margin`` or more). On a quiet machine more threads win the probe clearly (5 ms against 8 on 2 cores); on a
    busy one they lose it, by 2x on average but by little in a lucky window, so any loss counts."""
    most = max(seconds)
    best = min(seconds, key=lambda n: (seconds[n], -n))
    return best if seconds[best] * margin <= seconds[most] else most


def probe_threads(cpus: int) -> int:
    """Time a decode-like mix with ``cpus`` threads and with one (about 0.2 s in all) and keep the faster.

    On a CPU that another process keeps busy, every torch operator split over several threads waits for the thread
    the OS has descheduled: measured on a 2-core machine with one busy-looping process beside it, a 135M model decoded
    at 20 tok/s with 2 threads and 46 tok/s with 1 (65 tok/s with 2 on the quiet machine). The mix is a
    memory-bound matrix-vector product over 32 MB (the weights' stream) and a run of small element-wise ops (the
    per-layer dispatch)."""
    import statistics
    import time

    import torch

    if cpus <= 1:
        return 1
    before = torch.get_num_threads()
    w = torch.empty(4096, 4096, dtype=torch.bfloat16).fill_(0.01)
    x = torch.ones(1, 4096, dtype=torch.bfloat16)
    h = torch.ones(1, 576)

    def mix() -> None:
        y = h
        for _ in range(4):
            torch.nn.functional.linear(x, w)
        for _ in range(64):
            y = y * 1.0001 + 0.0001

    times: dict[int, list[float]] = {cpus: [], 1: []}
    try:
        for n in (cpus, 1):  # warm both pools
            torch.set_num_threads(n)
            mix()
        for _ in range(9):  # alternate, so a change in the machine's load hits both counts alike
            for n in (cpus, 1):
                torch.set_num_threads(n)
                t = time.perf_counter()
                mix()
                times[n].append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    # means: the scheduler sometimes hands a busy machine's cores over for a moment; a best-of-N (or a median of a
    # few) credits the multi-threaded run with that luck, while the stalls it meets the rest of the time count
    seconds = {n: statistics.fmean(ts) for n, ts in times.items()}
    chosen = pick_threads(seconds)
    logging.getLogger("rooflm").info("compute threads: %d (probe: %s)", chosen,
                                     ", ".join(f"{n} thread(s) {t * 1e3:.1f} ms" for n, t in seconds.items()))
    return chosen


def check_max_model_len(args: argparse.Namespace) -> None:
    """``--max-model-len`` against the model's max positions, read from its config (a named config, config.json or
    the GGUF header) before any weight loads; the engine checks again once the model is built."""
    value = getattr(args, "max_model_len", None)
    if value is None:
        return
    if value < 1:
        raise ValueError(f"--max-model-len {value}: must be >= 1")
    from rooflm.config import load_model_config

    model = args.model
    if model is None:
        from rooflm.loader.default_model import default_model_path

        model = default_model_path()
    try:
        limit = load_model_config(model).max_position_embeddings
    except (ValueError, OSError):  # a model that cannot be read: the engine says why when it loads
        return
    if value > limit:
        raise ValueError(f"--max-model-len {value}: must be <= {limit}, the max positions of {model}")


def engine_config_from_args(args: argparse.Namespace):
    from rooflm.config import EngineConfig

    check_max_model_len(args)
    set_compute_threads(getattr(args, "threads", None))
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
