"""Offline throughput: many requests through the engine at once; requests/s and tokens/s.

``rooflm bench throughput --model llama-2-7b --load-format dummy --num-prompts 256 --input-len 512 --output-len 128``

Method. ``--num-prompts`` requests of ``--input-len`` random token ids, each generating exactly ``--output-len``
tokens (greedy, EOS ignored), go to ``LLM.generate`` in one call after a short warm-up; the engine batches them
continuously (up to ``--max-num-seqs`` at once). Reported: requests/s, output tokens/s and total (prompt + output)
tokens/s over the wall time of that call. ``--baseline hf`` times transformers' eager ``generate`` on the same
weights over the first ``--hf-num-prompts`` prompts in batches of ``--hf-batch-size`` and prints the speed-up in
output tokens/s. Ceilings (copy bandwidth, matmul rate) are measured in the same process, as in ``bench latency``.
When the engine measures its live roofline (``rooflm.roofline.live``), the report gives the fraction of their best
possible time that the steps of the timed call ran at.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

from rooflm.bench.output import add_output_args, check_output_args, report_stream, write_outputs
from rooflm.bench.preflight import add_model_args, add_parallel_args, add_yes_arg, note
from rooflm.bench.reports import throughput_lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--num-prompts", type=int, default=256, help="requests in the batch")
    p.add_argument("--input-len", type=int, default=512,
                   help="prompt tokens per request (default: 512 with a GPU, 128 without)")
    p.add_argument("--output-len", type=int, default=128,
                   help="generated tokens per request (default: 128 with a GPU, 32 without)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded together at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="token budget of one engine step")
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="KV pool size (default: what --max-num-seqs requests need, plus 10%%)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    add_parallel_args(p)
    p.add_argument("--speculative-config", default=None, help="JSON, as the engine's speculative_config (default: off)")
    p.add_argument("--async-scheduling", default=None, choices=["on", "off"],
                   help="schedule step N+1 while step N runs (default: on for CUDA, off on the CPU)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "cpu"],
                   help="attention implementation")
    p.add_argument("--quantization", default=None,
                   help="none | w8a16 | w4a16 | gptq | awq | gguf | fp8 (default: what the checkpoint holds)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV cache element type (default auto: the model's dtype)")
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="hf: also time transformers' generate on the same weights")
    p.add_argument("--hf-num-prompts", type=int, default=64, help="with --baseline hf: prompts it runs")
    p.add_argument("--hf-batch-size", type=int, default=32, help="with --baseline hf: its batch size")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and weights")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr with requests and input/output tok/s, as vLLM's (default: on when "
                        "stderr is a terminal)")
    add_output_args(p)
    add_yes_arg(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from rooflm.bench.latency import (_async_flag, build_hf_model, hf_generate_time, kv_cache_bytes,
                                      check_lengths, measure_ceilings, preflight)
    from rooflm.engine.engine import resolve_device, resolve_dtype
    from rooflm.llm import LLM
    from rooflm.roofline.live import roofline_summary
    from rooflm.sampling_params import SamplingParams

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    N, L_in, L_out = args.num_prompts, args.input_len, args.output_len
    if min(N, L_in, L_out) < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    check_output_args(args)
    check_lengths(args)
    note(f"measuring this machine's ceilings ({device.type})")
    ceilings = measure_ceilings(device, dtype)
    seqs = min(args.max_num_seqs, N)
    kv_bytes = kv_cache_bytes(args, dtype, seqs * (L_in + L_out))
    # the roofline of N requests at once bounds the time of N requests batched continuously up to seqs
    preflight(args, device, ceilings, seqs, kv_bytes, -(-N // seqs))
    note(f"loading {args.model}")
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              max_model_len=L_in + L_out, kv_cache_memory=kv_bytes, max_num_seqs=seqs,
              max_num_batched_tokens=max(args.max_num_batched_tokens, L_in), enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, async_scheduling=_async_flag(args),
              speculative_config=args.speculative_config,
              attention_backend=args.attention_backend, seed=args.seed,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, show_progress=False,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              enable_expert_parallel=args.enable_expert_parallel)
    init_s = time.perf_counter() - t0
    engine = llm.engine
    cfg = engine.model_config
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, cfg.vocab_size, (N, L_in), generator=gen).tolist()
    warm = torch.randint(0, cfg.vocab_size, (min(N, 8), L_in), generator=gen).tolist()
    note("warm-up")
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    note(f"{N} requests")

    params = SamplingParams(temperature=0, max_tokens=L_out, ignore_eos=True)
    before = copy.copy(engine.get_stats())  # the live roofline of the timed call only
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty() if args.progress is None else args.progress)
    elapsed = time.perf_counter() - t0
    live = roofline_summary(engine.get_stats(), since=before)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res: dict = {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "num_prompts": N, "input_len": L_in,
        "output_len": L_out, "max_num_seqs": seqs, "ceilings": ceilings, "engine_init_s": init_s,
        "cuda_graphs": engine.runner.graph_runner is not None, "elapsed_s": elapsed,
        "tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
        "requests_per_s": N / elapsed, "output_tok_s": n_out / elapsed, "total_tok_s": (n_out + N * L_in) / elapsed,
    }
    if live:
        res["live_roofline"] = live
    if args.baseline == "hf":
        hf = build_hf_model(engine)
        sub = prompts[: args.hf_num_prompts]
        hf_generate_time(hf, sub[:1], 2)  # warm-up
        total, hf_out = 0.0, 0
        for i in range(0, len(sub), args.hf_batch_size):
            batch = sub[i: i + args.hf_batch_size]
            t, toks = hf_generate_time(hf, batch, L_out)
            total += t
            hf_out += sum(len(x) for x in toks)
        res["hf"] = {"num_prompts": len(sub), "batch_size": args.hf_batch_size, "elapsed_s": total,
                     "requests_per_s": len(sub) / total, "output_tok_s": hf_out / total}
        res["speedup_output_tok_s"] = res["output_tok_s"] / res["hf"]["output_tok_s"]
        del hf
    llm.shutdown()  # tensor- or pipeline-parallel workers
    with report_stream(args):
        _print(res)
    write_outputs(args, res)
    return 0


def _print(res: dict) -> None:
    for line in throughput_lines(res):
        print(line)
