"""Swap against recompute: the context length from which swapping a preempted request's KV beats recomputing it.

``rooflm bench swap --contexts 256,1024,4000``

A preempted request resumes either by recomputation (one prefill of its context, vLLM's default) or by swapping its
KV blocks out to host memory and back (Kwon et al. 2023, section 4.5). For each context length ``c`` this measures,
on one engine:

- **recompute**: the wall time of a prefill of ``c`` random prompt tokens through the engine (prefix caching off,
  the engine's own chunking and step overheads included) that samples one token: what resuming by recomputation
  costs. The engine runs synchronously here: under asynchronous scheduling a request of one token would also launch
  the decode step that follows its prefill before its token is read back;
- **swap**: the time of the copy of ``ceil(c / block_size)`` KV blocks (every layer, K and V) to host memory and back,
  through the engine's own copy path (``HostSwapSpace``: pinned buffer, side stream), each direction synchronised.
  The first round trip of each length is checked: the blocks come back bit for bit, else the benchmark fails.

Beside each it prints what ``--preemption-mode auto`` predicts (the live roofline's best prefill time on the
ceilings measured at start-up, against two transfers at the host link's bandwidth, measured on CUDA), and it reports
the measured crossover: the shortest context from which swapping is faster for that length and every longer one.
"""
from __future__ import annotations

import argparse
import statistics
import time

from rooflm.bench.output import add_output_args, check_output_args, report_stream, write_outputs
from rooflm.bench.preflight import add_model_args, note

__all__ = ["add_arguments", "run", "crossover", "parse_contexts", "time_swap_round_trip"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--contexts", default=None,
                   help="comma-separated context lengths in tokens (default: 128, 256, ... below the model's "
                        "max_model_len and the longest it allows, with a GPU; 16, 64, 256 without)")
    p.add_argument("--num-iters", type=int, default=3, help="timed repetitions per length (the median is reported)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step, so of one prefill chunk (default: the engine's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and weights")
    add_output_args(p)


def parse_contexts(text: str | None, max_model_len: int, has_gpu: bool) -> list[int]:
    """The context lengths to measure: ``text`` (comma-separated), else powers of two from 128 (16 without a GPU)
    below ``max_model_len`` and the longest prompt it allows. Each must leave room for the one sampled token."""
    longest = max_model_len - 1
    if text is None:
        values, c = [], 128 if has_gpu else 16
        while c < longest and len(values) < (8 if has_gpu else 3):
            values.append(c)
            c *= 2 if has_gpu else 4
        return values if not has_gpu or values[-1] * 2 < longest else values + [longest]
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--contexts={text!r}: expected comma-separated integers") from None
    if not values or values[0] < 1:
        raise ValueError(f"--contexts={text!r}: expected positive context lengths")
    if values[-1] > longest:
        raise ValueError(f"--contexts={text!r}: {values[-1]} tokens plus the sampled one exceed the model's "
                         f"max_model_len={max_model_len}")
    return values


def crossover(contexts: list[int], swap_faster: list[bool]) -> int | None:
    """The shortest context from which swapping wins for it and every longer one (None: recompute wins at the
    longest)."""
    best = None
    for c, faster in sorted(zip(contexts, swap_faster), reverse=True):
        if not faster:
            break
        best = c
    return best


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_swap_round_trip(space, kv_caches: list, num_blocks: int, device, verify: bool) -> tuple[float, float]:
    """Seconds of one swap-out and one swap-in of device blocks ``0..num_blocks-1`` through host blocks
    ``0..num_blocks-1``. ``verify``: fill the blocks with random values first and zero them between the two copies;
    raise if they do not come back unchanged."""
    import torch

    from rooflm.worker.swap_space import _parts

    ids = list(range(num_blocks))
    before = None
    if verify:
        for cache in kv_caches:
            for part in _parts(cache):
                part[:, :num_blocks] = torch.randint(-100, 100, part[:, :num_blocks].shape, device=device
                                                     ).to(part.dtype)
        before = [p[:, :num_blocks].clone() for cache in kv_caches for p in _parts(cache)]
    _sync(device)
    t0 = time.perf_counter()
    space.run(kv_caches, list(zip(ids, ids)), [])
    _sync(device)
    t_out = time.perf_counter() - t0
    if verify:
        for cache in kv_caches:
            for part in _parts(cache):
                part[:, :num_blocks] = 0
        _sync(device)
    t0 = time.perf_counter()
    space.run(kv_caches, [], list(zip(ids, ids)))
    _sync(device)
    t_in = time.perf_counter() - t0
    if before is not None:
        after = [p[:, :num_blocks] for cache in kv_caches for p in _parts(cache)]
        if not all(torch.equal(a, b) for a, b in zip(after, before)):
            raise RuntimeError(f"swap round trip of {num_blocks} blocks changed the KV: the copy path is broken")
    return t_out, t_in


def _prefill_seconds(engine, prompt: list[int]) -> float:
    from rooflm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    _sync(engine.device)
    t0 = time.perf_counter()
    engine.add_request(f"prefill-{len(prompt)}-{t0}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    import torch

    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine, resolve_device
    from rooflm.kv_cache.swap import choose_swap
    from rooflm.worker.swap_space import HostSwapSpace, _parts, host_link_bandwidth

    check_output_args(args)
    if args.num_iters < 1:
        raise ValueError(f"--num-iters {args.num_iters} is invalid: expected an integer >= 1")
    device = resolve_device(args.device)
    bs = args.block_size
    note(f"loading {args.model}")
    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    config = EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                          block_size=bs, max_num_seqs=1, seed=args.seed, enable_prefix_caching=False,
                          preemption_mode="recompute", async_scheduling=False, show_progress=False, **extra)
    engine = LLMEngine(config)
    contexts = parse_contexts(args.contexts, engine.max_model_len, device.type == "cuda")
    caches = engine.runner.kv_caches
    cfg = engine.model_config
    max_blocks = -(-contexts[-1] // bs)
    if max_blocks > engine.kv.num_blocks:
        raise ValueError(f"--contexts: {contexts[-1]} tokens need {max_blocks} KV blocks, the pool has "
                         f"{engine.kv.num_blocks}")
    per_block = sum(p[:, :1].nbytes for cache in caches for p in _parts(cache))
    space = HostSwapSpace(max_blocks, bs, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers,
                          engine.dtype, engine.config.kv_cache_dtype, engine.device)
    bandwidth = host_link_bandwidth(device)
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for c in contexts:
        n = -(-c // bs)
        prompt = torch.randint(100, cfg.vocab_size - 100, (c,), generator=g).tolist()
        for _ in range(2):  # warm-up of this shape (the first call of a new length ran 2-3x slower on an H100)
            _prefill_seconds(engine, prompt)
        time_swap_round_trip(space, caches, n, device, verify=True)
        recompute = statistics.median(_prefill_seconds(engine, prompt) for _ in range(args.num_iters))
        trips = [time_swap_round_trip(space, caches, n, device, verify=False) for _ in range(args.num_iters)]
        t_out = statistics.median(t for t, _ in trips)
        t_in = statistics.median(t for _, t in trips)
        predicted_recompute = engine.roofline.predict([c], [c], 1)
        nbytes = n * per_block
        rows.append({"context": c, "blocks": n, "kv_mib": nbytes / 2**20,
                     "recompute_ms": 1e3 * recompute, "swap_out_ms": 1e3 * t_out, "swap_in_ms": 1e3 * t_in,
                     "swap_ms": 1e3 * (t_out + t_in), "swap_gbps": 2 * nbytes / max(t_out + t_in, 1e-12) / 1e9,
                     "swap_faster": t_out + t_in < recompute,
                     "predicted_recompute_ms": 1e3 * predicted_recompute,
                     "predicted_swap_ms": 1e3 * 2 * nbytes / bandwidth,
                     "auto_swaps": choose_swap(predicted_recompute, nbytes, bandwidth)})
        note(f"context {c}: recompute {rows[-1]['recompute_ms']:.2f} ms, swap {rows[-1]['swap_ms']:.2f} ms")
    measured = crossover(contexts, [r["swap_faster"] for r in rows])
    predicted = crossover(contexts, [r["auto_swaps"] for r in rows])
    res = {"model": args.model, "dtype": str(engine.dtype).removeprefix("torch."), "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "block_size": bs, "kv_bytes_per_block": per_block, "host_link_gbps": bandwidth / 1e9,
           "measured_crossover_tokens": measured, "auto_crossover_tokens": predicted, "rows": rows}
    with report_stream(args):
        print(f"{args.model} {res['dtype']} on {res['device_name']}: KV {per_block / 2**10:.0f} KiB per block of {bs} "
              f"tokens; host link {bandwidth / 1e9:.1f} GB/s ({'measured' if device.type == 'cuda' else 'assumed'})")
        print(f"{'context':>8} {'KV MiB':>8} {'recompute ms':>13} {'swap out+in ms':>15} {'swap GB/s':>10} "
              f"{'faster':>10} {'auto: pred. recompute / swap ms':>32} {'auto':>10}")
        for r in rows:
            pred = f"{r['predicted_recompute_ms']:.2f} / {r['predicted_swap_ms']:.2f}"
            print(f"{r['context']:>8} {r['kv_mib']:>8.1f} {r['recompute_ms']:>13.2f} "
                  f"{r['swap_out_ms']:>7.2f}+{r['swap_in_ms']:<7.2f} {r['swap_gbps']:>10.1f} "
                  f"{'swap' if r['swap_faster'] else 'recompute':>10} {pred:>32} "
                  f"{'swap' if r['auto_swaps'] else 'recompute':>10}")
        print(f"measured crossover: {_words(measured, contexts)}; auto's rule: {_words(predicted, contexts)}")
    write_outputs(args, res, rows)
    return 0


def _words(c: int | None, contexts: list[int]) -> str:
    if c is None:
        return f"recompute up to {contexts[-1]} tokens"
    return "swap at every length measured" if c == contexts[0] else f"swap from {c} tokens"
