"""Multi-turn chat: mean time to first token with and without the prefix cache's host tier (``kv_offload_gb``).

``rooflm bench multiturn --num-users 8 --num-turns 4 --max-concurrency 2 --pool-fraction 0.25 --kv-offload-gb 0,auto``

Workload. ``--num-users`` conversations of ``--num-turns`` turns, interleaved round-robin (every user's first turn,
then every user's second turn, ...), at most ``--max-concurrency`` requests in flight (0: every user at once, each
sending its next turn as soon as its answer is complete). A turn's prompt is the conversation so far (every earlier
user text and the model's answers to it, as token ids) followed by ``--input-len`` new random token ids; the answer
is ``--output-len`` tokens (greedy, EOS ignored). So every prompt but the first of a conversation starts with a
prefix that was computed before, and freed since, while the other users' turns ran.

Pool. The *working set* is the KV of every conversation at its end (``users · turns · (input + output)`` tokens); the
device pool is ``--pool-fraction`` of it (``num_gpu_blocks_override``), at least one conversation. With a quarter, the
pool cannot keep every conversation's history between its turns: other users' turns evict it. Without a host tier
those prefixes are computed again; with one they are copied back from host memory.

Reported per setting of ``--kv-offload-gb`` (``auto``: enough host memory for the whole working set): mean and
median TTFT (from the turn's arrival to its first token, queueing included), wall time, prompt tokens computed,
prefix-cache and host-tier hits, preemptions. The engines share one loaded model; each starts with a warm-up request.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from rooflm.bench.output import add_output_args, check_output_args, report_stream, write_outputs
from rooflm.bench.preflight import add_model_args, note

__all__ = ["add_arguments", "run", "make_conversations", "pool_blocks", "run_trace"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--quantization", default=None, help="as the engine's quantization (default: the checkpoint's)")
    p.add_argument("--num-users", type=int, default=8, help="conversations running at once")
    p.add_argument("--num-turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--max-concurrency", type=int, default=2,
                   help="requests in flight at most, sent in round-robin order (0: every user at once)")
    p.add_argument("--input-len", type=int, default=256,
                   help="new user tokens per turn (default: 256 with a GPU, 128 without)")
    p.add_argument("--output-len", type=int, default=128,
                   help="answer tokens per turn (default: 128 with a GPU, 32 without)")
    p.add_argument("--pool-fraction", type=float, default=0.25, help="device KV pool / working set")
    p.add_argument("--kv-offload-gb", default="0,auto",
                   help="comma-separated host-tier sizes in GiB to compare; auto: the whole working set")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded together at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    p.add_argument("--seed", type=int, default=0, help="seed of the random user texts and weights")
    add_output_args(p)


@dataclass
class TraceResult:
    ttft_s: list[float]
    elapsed_s: float
    prompt_tokens_computed: int
    prefix_hit_tokens: int
    host_hit_tokens: int
    num_preemptions: int
    answers: list[list[list[int]]]  # [user][turn] answer token ids


def make_conversations(num_users: int, num_turns: int, input_len: int, vocab_size: int,
                       seed: int = 0) -> list[list[list[int]]]:
    """``[user][turn]`` new user token ids (random ids away from the ends of the vocabulary, where special tokens
    sit)."""
    if min(num_users, num_turns, input_len) < 1:
        raise ValueError(f"num_users={num_users}, num_turns={num_turns}, input_len={input_len}: all must be >= 1")
    rng = random.Random(seed)
    lo, hi = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size * 3 // 4)
    return [[[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(num_turns)] for _ in range(num_users)]


def pool_blocks(num_users: int, num_turns: int, input_len: int, output_len: int, block_size: int,
                fraction: float) -> int:
    """Device blocks holding ``fraction`` of the working set, and at least one whole conversation."""
    if not 0 < fraction <= 1:
        raise ValueError(f"pool_fraction={fraction} is invalid: expected a number in (0, 1]")
    conversation = num_turns * (input_len + output_len)
    blocks = -(-int(fraction * num_users * conversation) // block_size)
    return max(blocks, -(-conversation // block_size) + 1)


def run_trace(engine, conversations: list[list[list[int]]], output_len: int,
              max_concurrency: int = 0) -> TraceResult:
    """Drive ``engine`` through the conversations; every turn's prompt is the history so far plus the turn's user
    text. ``max_concurrency`` > 0: turns in round-robin order, at most that many in flight; 0: every user at once,
    each sending its next turn when its answer is complete."""
    from rooflm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    history: list[list[int]] = [[] for _ in conversations]
    answers: list[list[list[int]]] = [[] for _ in conversations]
    ttft: list[float] = []
    before = engine.get_stats()
    base = (before.prompt_tokens_total, before.prefix_hits, before.host_cache_hits, before.num_preemptions)

    def send(u: int) -> None:
        t = len(answers[u])
        history[u] = history[u] + conversations[u][t]
        engine.add_request(f"u{u}-t{t}", list(history[u]), params)

    order = [(u, t) for t in range(max(map(len, conversations))) for u in range(len(conversations))
             if t < len(conversations[u])]
    busy: set[int] = set()

    def fill() -> None:  # round-robin: the next turn waits for its user's previous answer and for a free seat
        while order and len(busy) < max_concurrency and order[0][0] not in busy:
            u, _ = order.pop(0)
            busy.add(u)
            send(u)

    t0 = time.perf_counter()
    if max_concurrency > 0:
        fill()
    else:
        for u in range(len(conversations)):
            send(u)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            u = int(out.request_id[1:out.request_id.index("-")])
            m = out.metrics
            ttft.append(m.first_token_time - m.arrival_time)
            answer = out.outputs[0].token_ids
            answers[u].append(list(answer))
            history[u] = history[u] + list(answer)
            if max_concurrency > 0:
                busy.discard(u)
                fill()
            elif len(answers[u]) < len(conversations[u]):
                send(u)
    elapsed = time.perf_counter() - t0
    s = engine.get_stats()
    return TraceResult(ttft, elapsed, s.prompt_tokens_total - base[0], s.prefix_hits - base[1],
                       s.host_cache_hits - base[2], s.num_preemptions - base[3], answers)


def _offload_sizes(text: str, working_set_bytes: int) -> list[float]:
    sizes = []
    for part in text.split(","):
        part = part.strip()
        try:
            sizes.append(1.05 * working_set_bytes / 2**30 if part == "auto" else float(part))
        except ValueError:
            raise ValueError(f"--kv-offload-gb={text!r}: expected GiB numbers or 'auto', comma-separated") from None
    return sizes


def run(args: argparse.Namespace) -> int:
    import torch

    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine, resolve_device, resolve_dtype
    from rooflm.worker.model_runner import kv_bytes_per_block
    from rooflm.loader import load_model
    from rooflm.sampling_params import SamplingParams

    check_output_args(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    U, T, L_in, L_out, bs = args.num_users, args.num_turns, args.input_len, args.output_len, args.block_size
    blocks = pool_blocks(U, T, L_in, L_out, bs, args.pool_fraction)
    note(f"loading {args.model}")
    model, cfg = load_model(args.model, load_format=args.load_format, dtype=dtype, device=device,
                            quantization=args.quantization, seed=args.seed, show_progress=False)
    per_block = kv_bytes_per_block(cfg, bs, dtype, "auto")
    working_set = U * T * (L_in + L_out)
    sizes = _offload_sizes(args.kv_offload_gb, -(-working_set // bs) * per_block)
    conversations = make_conversations(U, T, L_in, cfg.vocab_size, args.seed)
    if args.max_concurrency < 0:
        raise ValueError(f"--max-concurrency {args.max_concurrency} is invalid: expected an integer >= 0")
    res: dict = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "num_users": U, "num_turns": T,
                 "max_concurrency": args.max_concurrency,
                 "input_len": L_in, "output_len": L_out, "working_set_tokens": working_set,
                 "pool_blocks": blocks, "pool_tokens": blocks * bs, "runs": []}
    for gb in sizes:
        config = EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                              block_size=bs, num_gpu_blocks_override=blocks, max_model_len=T * (L_in + L_out),
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              kv_offload_gb=gb, seed=args.seed, show_progress=False)
        engine = LLMEngine(config, model=model, model_config=cfg, tokenizer=None)
        engine.add_request("warm-up", conversations[0][0][:8], SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished_requests():  # (8 tokens: not a full block, so nothing of it is cached)
            engine.step()
        note(f"kv_offload_gb={gb:g}: {U} users x {T} turns")
        r = run_trace(engine, conversations, L_out, args.max_concurrency)
        res["runs"].append({"kv_offload_gb": gb, "mean_ttft_ms": 1e3 * statistics.fmean(r.ttft_s),
                            "median_ttft_ms": 1e3 * statistics.median(r.ttft_s), "elapsed_s": r.elapsed_s,
                            "prompt_tokens_computed": r.prompt_tokens_computed,
                            "prefix_hit_tokens": r.prefix_hit_tokens, "host_hit_tokens": r.host_hit_tokens,
                            "num_preemptions": r.num_preemptions})
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with report_stream(args):
        print(f"{U} users x {T} turns of {L_in} + {L_out} tokens, {args.max_concurrency or U} in flight: working set {working_set} tokens, device pool "
              f"{blocks * bs} tokens ({args.pool_fraction:g}); {args.model} {res['dtype']} on {device}")
        print(f"{'host GiB':>9} {'mean TTFT ms':>13} {'median ms':>10} {'wall s':>8} {'prompt computed':>16} "
              f"{'device hits':>12} {'host hits':>10} {'preempt':>8}")
        for x in res["runs"]:
            print(f"{x['kv_offload_gb']:>9.3g} {x['mean_ttft_ms']:>13.1f} {x['median_ttft_ms']:>10.1f} "
                  f"{x['elapsed_s']:>8.2f} {x['prompt_tokens_computed']:>16} {x['prefix_hit_tokens']:>12} "
                  f"{x['host_hit_tokens']:>10} {x['num_preemptions']:>8}")
    write_outputs(args, res, res["runs"])
    return 0
