"""Latency of one batch through the engine: TTFT, TPOT, tokens/s, achieved GB/s and the fraction of the roofline.

``rooflm bench latency --model llama-2-7b --load-format dummy --batch-size 1 --input-len 1024 --output-len 128``

Method. The engine runs ``--batch-size`` requests of ``--input-len`` random token ids, each generating exactly
``--output-len`` tokens (greedy, EOS ignored), ``--num-iters`` times after ``--num-iters-warmup`` warm-up runs, with
fresh prompts each time and prefix caching off (so no run reuses another's cache). Per iteration:
- TTFT: from adding the requests until every request has its first token (the prefill, chunked if it must be);
- TPOT: from the moment every request has its first token to the last token, divided by output_len - 1;
- decode tokens/s = batch / TPOT; end-to-end tokens/s = batch * output_len / total time.
Figures are medians over the iterations. When the engine measures its live roofline (``rooflm.roofline.live``), the
report gives the fraction of their best possible time that the timed steps ran at. ``--profile`` (CUDA) profiles
16 further decode steps of batch 1 and of ``--batch-size`` and reports the GPU idle time between consecutive steps
(``rooflm.bench.gpu_gaps``). The ceilings are measured in the same process on the same device: memory
bandwidth by a 1 GiB device copy (bytes read + written) and the dense matmul rate (8192^3) in the run's dtype. The
roofline (``rooflm.roofline.analyze`` on those measured ceilings) gives the best possible TTFT and TPOT and the bytes a
decode step must move; achieved GB/s = those bytes / measured TPOT. ``--baseline hf`` builds Hugging Face
transformers' model of the same architecture in the same process, copies rooflm's weights into it, and times its
eager ``generate`` on the same prompts, printing the speed-up. ``--baseline llama.cpp`` times llama.cpp on the same
GGUF file, prompt ids and thread count, in a child process, right after rooflm (``rooflm.bench.llamacpp``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time

from rooflm.bench.output import add_output_args, check_output_args, report_stream, write_outputs
from rooflm.bench.preflight import add_parallel_args, add_yes_arg, kv_format, note, roofline_bounds
from rooflm.bench.reports import latency_lines, profile_lines  # noqa: F401 - profile_lines: part of this module's API


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-2-7b", help="named config, checkpoint folder or .gguf (default: the embedded SmolLM2-135M "
                                                  "GGUF without a GPU, llama-2-7b with one)")
    p.add_argument("--load-format", default="auto",
                   help="auto (default: a named config gets random weights, a file or folder its own), dummy, "
                        "safetensors, gguf")
    p.add_argument("--dtype", default=None,
                   help="float16, bfloat16 or float32 (default: float16 on a GPU, float32 on the CPU)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    p.add_argument("--batch-size", type=int, default=1, help="requests run together")
    p.add_argument("--input-len", type=int, default=1024,
                   help="prompt tokens per request (default: 1024 with a GPU, 128 without)")
    p.add_argument("--output-len", type=int, default=128,
                   help="generated tokens per request (default: 128 with a GPU, 32 without)")
    p.add_argument("--num-iters", type=int, default=3, help="timed iterations (the report gives medians)")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", default=None, choices=["on", "off"],
                   help="schedule step N+1 while step N runs (default: on for CUDA, off on the CPU)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "cpu"],
                   help="attention implementation")
    p.add_argument("--quantization", default=None,
                   help="none | w8a16 | w4a16 | gptq | awq | gguf | fp8 (default: what the checkpoint holds)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV cache element type (default auto: the model's dtype)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: max(2048, input_len), so one prompt is one prefill step)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="KV pool size (default: what the batch needs, plus 10%%)")
    p.add_argument("--baseline", choices=["none", "hf", "llama.cpp"], default="none",
                   help="none; hf: also time transformers' generate on the same weights and prompts; llama.cpp: time "
                        "llama.cpp (llama-cpp-python, same threads) on the same .gguf file and prompts (batch 1)")
    add_parallel_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and weights")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="also time the same prompts with this speculative_config (same model, same process) and "
                        "report the speed-up, acceptance rate and mean accepted length (default: off)")
    add_output_args(p)
    add_yes_arg(p)
    p.add_argument("--profile", nargs="?", const="", default=None, metavar="FILE",
                   help="CUDA only: profile 16 decode steps (batch 1 and --batch-size) with torch.profiler and report "
                        "the GPU idle time between consecutive steps; FILE: also write the operator tables there")
    p.add_argument("--profile-trace", default=None, metavar="PATH",
                   help="with --profile: write the Chrome traces to PATH with .batch<N> before its extension")


# ---------------------------------------------------------------------------------------------------------------------
# Shared with bench/throughput.py
# ---------------------------------------------------------------------------------------------------------------------
def _async_flag(args: argparse.Namespace) -> bool | None:
    """``--async-scheduling on|off`` -> the engine's ``async_scheduling`` (None: the device's default)."""
    value = getattr(args, "async_scheduling", None)
    return None if value is None else value == "on"


def measure_ceilings(device, dtype) -> dict:
    """This machine's roofs, measured in this process (``rooflm.roofline.measure``): copy bandwidth (bytes read +
    written per second) of a 1 GiB copy and the dense matmul rate in the run's dtype (fp16 for float32 runs on a GPU)."""
    import torch

    from rooflm.roofline.measure import measure_bandwidth, measure_matmul_peak

    dev = str(device)
    if device.type != "cuda":
        _, peak = measure_matmul_peak(dev)
        return {"device": "cpu", "copy_gbps": measure_bandwidth(dev) / 1e9, "matmul_tflops": peak / 1e12}
    copy_gbps = measure_bandwidth(dev, nbytes=2**30, reps=10) / 1e9
    mm_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16
    _, peak = measure_matmul_peak(dev, n=8192, reps=10, dtype=mm_dtype)
    torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(device), "copy_gbps": copy_gbps, "matmul_tflops": peak / 1e12,
            "matmul_dtype": str(mm_dtype).removeprefix("torch.")}


def kv_cache_bytes(args: argparse.Namespace, dtype, tokens: int, block_size: int = 16) -> int:
    """The KV pool for a benchmark: ``--kv-cache-memory-gib`` if given, else what ``tokens`` need (+64 blocks, +10%)."""

    from rooflm.config import load_model_config

    if args.kv_cache_memory_gib:
        return int(args.kv_cache_memory_gib * 2**30)
    from rooflm.attention.kv_quant import kv_bytes_per_token_head

    cfg = load_model_config(args.model)
    # K and V of one token and head, in the cache's element type (int8 / fp8 with their scales when quantized)
    per_head = kv_bytes_per_token_head(cfg.head_dim, dtype, getattr(args, "kv_cache_dtype", "auto"))
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * per_head
    return int(per_token * (tokens + 64 * block_size) * 1.1)


def build_hf_model(engine):
    """transformers' model of the engine's architecture with the engine's weights copied in (same device, dtype)."""
    import torch
    import transformers

    cfg = engine.model_config
    extra = {k: v for k, v in cfg.hf_config.items() if k not in ("model_type", "architectures")}
    hf_cfg = transformers.AutoConfig.for_model(cfg.model_type, **extra)
    hf_cfg.architectures = [cfg.architecture]
    with torch.device(engine.device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=engine.dtype)
        except TypeError:
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=engine.dtype)
    model = model.to(engine.device, engine.dtype).eval()
    targets = engine.model.weight_targets()
    with torch.no_grad():
        for name, param in model.named_parameters():
            t = targets.get(name)
            if t is None:
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                raise ValueError(f"transformers' {name} has no rooflm counterpart")
            param.copy_(t.view())
    return model


def hf_generate_time(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for transformers' eager greedy generate of exactly ``new_tokens`` tokens per prompt (one batch of
    equal-length prompts), and the tokens."""
    import torch

    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, device=dev)
    torch.cuda.synchronize(dev) if dev.type == "cuda" else None
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    torch.cuda.synchronize(dev) if dev.type == "cuda" else None
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


# ---------------------------------------------------------------------------------------------------------------------
def _one_iteration(engine, prompts: list[list[int]], output_len: int) -> dict:
    from rooflm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    B = len(prompts)
    order = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        order.append(engine.add_request(f"lat-{time.monotonic_ns()}-{i}", p, params))
    t_first = None
    decode_steps = []  # durations of steps in which every request decoded one token
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        all_started = t_first is not None
        s = time.perf_counter()
        outs = engine.step()
        e = time.perf_counter()
        new = 0
        for o in outs:
            ids = o.outputs[0].token_ids
            new += len(ids) - len(tokens.get(o.request_id, ()))
            tokens[o.request_id] = list(ids)
        if all_started and new == B:
            decode_steps.append(e - s)
        if t_first is None and len(tokens) == B and all(tokens.values()):
            t_first = e
    t_end = time.perf_counter()
    # TPOT over the whole decode phase, from the first token of every request to the last (vLLM's definition). Under
    # asynchronous scheduling a step() call returns the previous step's tokens, so single calls are not single steps.
    tpot = (t_end - t_first) / (output_len - 1) if output_len > 1 else float("nan")
    return {"ttft_s": t_first - t0, "tpot_s": tpot,
            "e2e_s": t_end - t0, "decode_steps": len(decode_steps), "tokens": [tokens[r] for r in order]}


def run(args: argparse.Namespace) -> int:
    import torch

    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine, resolve_device, resolve_dtype
    from rooflm.roofline.live import roofline_summary

    device = resolve_device(args.device)
    if args.dtype is None:
        args.dtype = "float16" if device.type == "cuda" else "float32"
    dtype = resolve_dtype(args.dtype, device)
    B, L_in, L_out = args.batch_size, args.input_len, args.output_len
    if min(B, L_in, L_out) < 1:
        raise ValueError("--batch-size, --input-len and --output-len must be >= 1")
    check_output_args(args)
    check_lengths(args)
    if args.baseline == "llama.cpp":
        _check_llamacpp_args(args, B)
    profiling = args.profile is not None or args.profile_trace is not None
    if profiling and device.type != "cuda":
        raise ValueError(f"--profile needs a CUDA device: it measures GPU idle time between decode steps "
                         f"(this run is on {device.type})")
    note(f"measuring this machine's ceilings ({device.type})")
    ceilings = measure_ceilings(device, dtype)
    kv_bytes = kv_cache_bytes(args, dtype, B * (L_in + L_out))
    preflight(args, device, ceilings, B, kv_bytes, args.num_iters + args.num_iters_warmup)
    note(f"loading {args.model}")
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        max_model_len=L_in + L_out, kv_cache_memory=kv_bytes, max_num_seqs=B,
        max_num_batched_tokens=args.max_num_batched_tokens or max(2048, L_in), enable_prefix_caching=False,
        enforce_eager=args.enforce_eager, async_scheduling=_async_flag(args),
        attention_backend=args.attention_backend, seed=args.seed, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        show_progress=False))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    init_s = time.perf_counter() - t0
    gr = engine.runner.graph_runner
    capture_s = gr.capture_seconds if gr is not None else 0.0
    cfg = engine.model_config
    backend = sorted({getattr(m.backend, "name", "?") for m in engine.model.modules() if hasattr(m, "backend")})

    gen = torch.Generator().manual_seed(args.seed)

    def prompts() -> list[list[int]]:
        return torch.randint(0, cfg.vocab_size, (B, L_in), generator=gen).tolist()

    note(f"warm-up: {args.num_iters_warmup} iteration(s); then {args.num_iters} timed")
    t0 = time.perf_counter()
    for _ in range(args.num_iters_warmup):
        _one_iteration(engine, prompts(), min(L_out, 16))
    warmup_s = time.perf_counter() - t0
    before = copy.copy(engine.get_stats())  # the live roofline of the timed iterations only
    iters = []
    last_prompts = None
    timed_prompts = []
    for _ in range(args.num_iters):
        last_prompts = prompts()
        timed_prompts.append(last_prompts)
        iters.append(_one_iteration(engine, last_prompts, L_out))
    live = roofline_summary(engine.get_stats(), since=before)
    med = {k: statistics.median(it[k] for it in iters) for k in ("ttft_s", "tpot_s", "e2e_s")}
    res: dict = {
        "command": "rooflm bench latency " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "latency"] else "",
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "batch_size": B, "input_len": L_in,
        "output_len": L_out, "attention_backend": backend, "cuda_graphs": gr is not None,
        # the roofline figures below are for one device holding the whole model, also under these splits;
        # "split_roofline" (tensor parallelism): that bound divided over the devices
        "tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
        "enable_expert_parallel": getattr(args, "enable_expert_parallel", False),
        "graph_sizes": gr.sizes if gr is not None else [], "ceilings": ceilings,
        "engine_init_s": init_s, "graph_capture_s": capture_s, "warmup_s": warmup_s,
        "ttft_s": med["ttft_s"], "tpot_s": med["tpot_s"], "e2e_s": med["e2e_s"],
        "decode_tok_s": B / med["tpot_s"], "e2e_tok_s": B * L_out / med["e2e_s"],
        "iterations": [{k: v for k, v in it.items() if k != "tokens"} for it in iters],
    }
    if live:
        res["live_roofline"] = live
    from rooflm.bench.preflight import weight_bits
    from rooflm.quantization.apply import weight_format

    # a float model's weights take its dtype's bytes (a float32 run on the CPU moves 4 bytes per weight, not 2)
    bounds = roofline_bounds(cfg, ceilings, B, L_in, L_out,
                             w_bits=weight_format(engine.model) or weight_bits(res["dtype"], None),
                             kv_bits=kv_format(cfg.head_dim, res["dtype"], args.kv_cache_dtype),
                             expert_parallel_size=args.tensor_parallel_size if res["enable_expert_parallel"] else 1)
    if bounds:
        res["roofline"] = bounds
        res["achieved_gbps"] = bounds["decode_step_bytes"] / med["tpot_s"] / 1e9
        res["fraction_of_roofline_tpot"] = bounds["tpot_s"] / med["tpot_s"]
        res["fraction_of_copy_bandwidth"] = res["achieved_gbps"] / ceilings["copy_gbps"]
        res["prefill_tflops"] = bounds["prefill_ops"] / med["ttft_s"] / 1e12
        res["prefill_fraction_of_matmul_peak"] = res["prefill_tflops"] / ceilings["matmul_tflops"]
        res["fraction_of_roofline_ttft"] = bounds["ttft_s"] / med["ttft_s"]
        tp = args.tensor_parallel_size
        if tp > 1:  # the same bytes and FLOPs spread evenly over tp devices, collectives free: their combined roof
            res["split_roofline"] = {"devices": tp, "tpot_s": bounds["tpot_s"] / tp}
            res["fraction_of_split_roofline_tpot"] = bounds["tpot_s"] / tp / med["tpot_s"]
        if "ep_tpot_s" in bounds:
            res["expert_parallel_roofline"] = {"devices": tp, "tpot_s": bounds["ep_tpot_s"]}
            res["fraction_of_expert_parallel_roofline_tpot"] = bounds["ep_tpot_s"] / med["tpot_s"]
    try:
        from rooflm.kernels import gemv

        res["gemv_choices"] = {f"M<={k[0]} N={k[1]} K={k[2]}": (v if isinstance(v, str) else gemv._short(v))
                               for k, v in gemv.choices().items()}
        from rooflm.kernels import fused_gemv  # which fused projections were measured faster than their parts

        res["fused_gemv_choices"] = {f"{k[0]} M={k[1]} N={k[2]} K={k[3]}": fused_gemv._name(v)
                                     for k, v in fused_gemv.choices().items()}
        from rooflm.kernels import quant_gemv  # the one-row GEMV of packed weights: tiles or the general kernel

        res["quant_gemv_choices"] = {f"N={k[0]} K={k[1]} bits={k[2]} group={k[3]}": v
                                     for k, v in quant_gemv.choices().items()}
        from rooflm.kernels import quant_mlp  # the fused MLP of packed weights, or the pair of word GEMVs

        res["quant_mlp_choices"] = {f"gate_up={k[0]}x{k[1]} down={k[1]}x{k[2]} bits={k[3]}": v
                                    for k, v in quant_mlp.choices().items()}
    except Exception:  # noqa: BLE001 - triton missing: nothing to report
        pass

    if getattr(args, "speculative_config", None):
        from rooflm.bench.speculative import latency_comparison

        res["speculative"] = latency_comparison(engine, args.speculative_config, timed_prompts, iters, L_out,
                                                _one_iteration, res)
    if args.baseline == "hf":
        t0 = time.perf_counter()
        hf = build_hf_model(engine)
        res["hf_build_s"] = time.perf_counter() - t0
        hf_generate_time(hf, last_prompts[:1], 2)  # warm-up
        t1, _ = hf_generate_time(hf, last_prompts, 1)
        tn, hf_tokens = hf_generate_time(hf, last_prompts, L_out)
        hf_tpot = (tn - t1) / max(1, L_out - 1)
        res["hf"] = {"ttft_s": t1, "e2e_s": tn, "tpot_s": hf_tpot, "decode_tok_s": B / hf_tpot,
                     "e2e_tok_s": B * L_out / tn}
        res["speedup_decode"] = res["decode_tok_s"] / res["hf"]["decode_tok_s"]
        res["speedup_e2e"] = res["e2e_tok_s"] / res["hf"]["e2e_tok_s"]
        ours = iters[-1]["tokens"][0]
        same = next((i for i, (a, b) in enumerate(zip(ours, hf_tokens[0])) if a != b), min(len(ours), L_out))
        res["hf_greedy_tokens_agree_prefix"] = same
        del hf
        torch.cuda.empty_cache() if device.type == "cuda" else None

    if args.baseline == "llama.cpp":
        _llamacpp_baseline(res, engine, last_prompts, L_out)

    if profiling:
        res["profile"] = {}
        for b in sorted({1, B}):
            res["profile"][f"batch_{b}"] = _profile(engine, prompts()[:b], args.profile if b == B else "",
                                                    args.profile_trace)
    engine.shutdown()  # tensor- or pipeline-parallel workers
    with report_stream(args):
        _print(res)
    write_outputs(args, res)
    return 0


def check_lengths(args: argparse.Namespace) -> None:
    """Prompt + output against the model's max positions, from its config, before anything is measured or loaded."""
    from rooflm.config import load_model_config

    limit = load_model_config(args.model).max_position_embeddings
    if args.input_len + args.output_len > limit:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len}: must be <= {limit}, the max "
                         f"positions of {args.model}")


def preflight(args: argparse.Namespace, device, ceilings: dict, batch: int, kv_bytes: int, iterations: int) -> None:
    """The run's memory and roofline time before the model loads (``rooflm.bench.preflight``): refused when it
    cannot fit, or when it is long and ``--yes`` is not given. Shared with bench/throughput.py."""
    from rooflm.bench import preflight as pf
    from rooflm.config import load_model_config

    cfg = load_model_config(args.model)
    est = pf.estimate(cfg, ceilings, pf.weight_bits(args.dtype, args.quantization), batch,
                      args.input_len, args.output_len, iterations, kv_bytes,
                      kv_bits=kv_format(cfg.head_dim, args.dtype, getattr(args, "kv_cache_dtype", "auto")))
    world = getattr(args, "tensor_parallel_size", 1) * getattr(args, "pipeline_parallel_size", 1)
    if est is not None and world > 1:
        # each rank holds 1/world of the weights and a KV pool of kv_bytes: on CUDA each on its own device (the free
        # memory is one device's), on the CPU all of them in the host's memory
        if device.type == "cuda":
            est = dataclasses.replace(est, weights_bytes=est.weights_bytes / world)
        else:
            est = dataclasses.replace(est, kv_bytes=est.kv_bytes * world)
    pf.check(est, pf.available_memory(device.type), args.yes, args.model)


def _check_llamacpp_args(args: argparse.Namespace, batch: int) -> None:
    from rooflm.bench.llamacpp import INSTALL_HINT, available

    if batch != 1:
        raise ValueError(f"--baseline llama.cpp runs one sequence at a time: use --batch-size 1 (got {batch})")
    if not str(args.model).endswith(".gguf"):
        raise ValueError(f"--baseline llama.cpp needs a .gguf --model, got {args.model!r}")
    if not available():
        raise ValueError(INSTALL_HINT)


def _llamacpp_baseline(res: dict, engine, prompts: list[list[int]], output_len: int) -> None:
    import torch

    from rooflm.bench.llamacpp import run_baseline

    threads = torch.get_num_threads()
    base = run_baseline(engine.config.model, prompts, output_len, threads)
    res["llama.cpp"] = {k: v for k, v in base.items() if k != "tokens"}
    res["speedup_vs_llamacpp_decode"] = res["decode_tok_s"] / base["decode_tok_s"]
    res["speedup_vs_llamacpp_e2e"] = res["e2e_tok_s"] / base["e2e_tok_s"]
    res["threads"] = threads


PROFILE_STEPS = 16


def _profile(engine, prompts: list[list[int]], table_path: str, trace_path: str | None) -> dict:
    """torch.profiler over PROFILE_STEPS decode steps of ``prompts``, each inside a ``rooflm_step`` marker: the GPU
    idle time between consecutive steps; the operator tables to ``table_path`` (if not empty), the Chrome trace to
    ``trace_path`` with ``.batch<N>`` before its extension (if given)."""
    import json
    import os
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from rooflm.bench.gpu_gaps import STEP_MARKER, activity_from_trace, step_gaps_us, summarize_gaps
    from rooflm.sampling_params import SamplingParams

    B = len(prompts)
    params = SamplingParams(temperature=0, max_tokens=PROFILE_STEPS + 4, ignore_eos=True)
    keep = max(1, engine.max_model_len - PROFILE_STEPS - 4)
    counts: dict[str, int] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"prof-{time.monotonic_ns()}-{i}", p[:keep], params)
    while len(counts) < B or min(counts.values()) < 2:  # prefill and one decode step outside the profile
        for o in engine.step():
            counts[o.request_id] = len(o.outputs[0].token_ids)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_STEPS):
            with record_function(STEP_MARKER):
                engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / PROFILE_STEPS
    while engine.has_unfinished_requests():
        engine.step()
    if trace_path:
        root, ext = os.path.splitext(trace_path)
        path = f"{root}.batch{B}{ext or '.json'}"
    else:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        if not trace_path:
            os.unlink(path)
    activity, steps = activity_from_trace(trace)
    out = {"batch": B, "steps": len(steps), "step_wall_ms": wall * 1e3, **summarize_gaps(step_gaps_us(activity, steps))}
    if trace_path:
        out["trace"] = path
    if table_path:
        ka = prof.key_averages()
        with open(table_path, "w") as f:
            f.write(f"{PROFILE_STEPS} decode steps of batch {B}, {wall * 1e3:.2f} ms per step (wall, under the "
                    "profiler)\n\n")
            f.write(ka.table(sort_by="device_time_total", row_limit=40))
            f.write("\n\n")
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40))
        out["tables"] = table_path
    return out


def _print(r: dict) -> None:
    for line in latency_lines(r):
        print(line)
    if "speculative" in r:
        from rooflm.bench.speculative import latency_line

        print(latency_line(r["speculative"]))
