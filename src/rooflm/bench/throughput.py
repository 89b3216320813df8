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
import json
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="KV pool size (default: what --max-num-seqs requests need, plus 10%%)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--speculative-config", default=None, help="JSON, as the engine's speculative_config")
    p.add_argument("--async-scheduling", default=None, choices=["on", "off"],
                   help="schedule step N+1 while step N runs (default: on for CUDA, off on the CPU)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "cpu"])
    p.add_argument("--quantization", default=None,
                   help="none | w8a16 | w4a16 | gptq | awq | gguf | fp8 (default: what the checkpoint holds)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV cache element type (default auto: the model's dtype)")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--hf-num-prompts", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> int:
    import torch

    from rooflm.bench.latency import _async_flag, build_hf_model, hf_generate_time, kv_cache_bytes, measure_ceilings
    from rooflm.engine.engine import resolve_device, resolve_dtype
    from rooflm.llm import LLM
    from rooflm.roofline.live import roofline_summary
    from rooflm.sampling_params import SamplingParams

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    N, L_in, L_out = args.num_prompts, args.input_len, args.output_len
    if min(N, L_in, L_out) < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    ceilings = measure_ceilings(device, dtype)
    seqs = min(args.max_num_seqs, N)
    kv_bytes = kv_cache_bytes(args, dtype, seqs * (L_in + L_out))
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              max_model_len=L_in + L_out, kv_cache_memory=kv_bytes, max_num_seqs=seqs,
              max_num_batched_tokens=max(args.max_num_batched_tokens, L_in), enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, async_scheduling=_async_flag(args),
              speculative_config=args.speculative_config,
              attention_backend=args.attention_backend, seed=args.seed,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, show_progress=False)
    init_s = time.perf_counter() - t0
    engine = llm.engine
    cfg = engine.model_config
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, cfg.vocab_size, (N, L_in), generator=gen).tolist()
    warm = torch.randint(0, cfg.vocab_size, (min(N, 8), L_in), generator=gen).tolist()
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    params = SamplingParams(temperature=0, max_tokens=L_out, ignore_eos=True)
    before = copy.copy(engine.get_stats())  # the live roofline of the timed call only
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    live = roofline_summary(engine.get_stats(), since=before)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res: dict = {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "num_prompts": N, "input_len": L_in,
        "output_len": L_out, "max_num_seqs": seqs, "ceilings": ceilings, "engine_init_s": init_s,
        "cuda_graphs": engine.runner.graph_runner is not None, "elapsed_s": elapsed,
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
    _print(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


def _print(res: dict) -> None:
    from rooflm.roofline.live import roofline_line

    c = res["ceilings"]
    print(f"rooflm bench throughput: {res['model']} {res['dtype']} {res['num_prompts']} prompts x "
          f"({res['input_len']} in, {res['output_len']} out), max_num_seqs={res['max_num_seqs']}, on {c['device']} "
          f"(CUDA graphs {'on' if res['cuda_graphs'] else 'off'})")
    print(f"  {res['requests_per_s']:.2f} requests/s, {res['output_tok_s']:.0f} output tokens/s, "
          f"{res['total_tok_s']:.0f} total tokens/s ({res['elapsed_s']:.1f} s; "
          f"engine init {res['engine_init_s']:.1f} s)")
    line = roofline_line(res.get("live_roofline"))
    if line:
        print(f"  {line}")
    if "hf" in res:
        h = res["hf"]
        print(f"  transformers generate ({h['num_prompts']} prompts, batches of {h['batch_size']}): "
              f"{h['requests_per_s']:.2f} requests/s, {h['output_tok_s']:.0f} output tokens/s; "
              f"speed-up {res['speedup_output_tok_s']:.1f}x")
