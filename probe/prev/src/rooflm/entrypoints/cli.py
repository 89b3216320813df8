"""``rooflm generate``, ``rooflm chat`` and ``rooflm demo``."""
from __future__ import annotations

import argparse
import sys

from rooflm.entrypoints.args import add_engine_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete prompts with continuous batching")
    add_engine_args(p)
    _add_sampling_args(p)
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompts, one batch (quote each one)")
    p.set_defaults(func=_generate)

    p = sub.add_parser("chat", help="chat interactively with the model (tokens stream as they come)")
    add_engine_args(p)
    _add_sampling_args(p, max_tokens=256, temperature=0.7)
    p.add_argument("--system", default=None, help="a system prompt (default: none)")
    p.set_defaults(func=_chat)

    p = sub.add_parser("demo", help="a few dozen prompts through continuous batching, one streamed, then a report")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=32, help="prompts run together")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens generated per prompt at most")
    p.set_defaults(func=_demo)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 64, temperature: float = 0.0) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=temperature, help="0: greedy; higher: more random")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: smallest set of tokens with this much probability (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than min-p times the most likely one (0: off)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens generated per prompt at most")
    g.add_argument("--sample-seed", dest="sampling_seed", type=int, default=None,
                   help="seed of each request's sampling (default: none, random; --seed seeds the engine)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable; default: none)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens seen before by this (1: off)")


def _sampling_params(args: argparse.Namespace):
    from rooflm.sampling_params import SamplingParams

    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, max_tokens=args.max_tokens, seed=args.sampling_seed, stop=args.stop,
                          repetition_penalty=args.repetition_penalty)


def _generate(args: argparse.Namespace) -> int:
    """Generate for every prompt in one batch. On a terminal the first prompt's text streams as it is generated;
    the others (and every one when the output is a file or a pipe) print as one line each at the end. Timings go
    to stderr. Ctrl-C stops the generation and prints what was generated (exit 130)."""
    from rooflm.entrypoints.args import engine_config_from_args
    from rooflm.entrypoints.streaming import Timings, drive, stop_on_ctrl_c
    from rooflm.llm import LLM

    params = _sampling_params(args)
    llm = LLM(**vars(engine_config_from_args(args)))
    engine = llm.engine
    ids = [engine.add_request(None, prompt, params) for prompt in args.prompts]
    tty = sys.stdout.isatty() and params.n == 1
    if tty:
        print(args.prompts[0], end="", flush=True)
    with stop_on_ctrl_c() as stop:
        finals = drive(engine, ids[0] if tty else None, sys.stdout if tty else None, stop, ids)
    if tty:
        print(flush=True)
    timings = Timings()
    for i, (rid, prompt) in enumerate(zip(ids, args.prompts)):
        out = finals.get(rid)
        if out is None:
            continue
        timings.add(out)
        if tty and i == 0:
            continue
        for c in out.outputs:
            tag = f"[{rid}]" if params.n == 1 else f"[{rid}.{c.index}]"
            reason = c.finish_reason if c.finish_reason not in (None, "abort") else "interrupted"
            print(f"{tag} {prompt!r} -> {c.text!r} ({reason}, {len(c.token_ids)} tokens)")
    print(timings.report(), file=sys.stderr, flush=True)
    return 130 if stop.is_set() else 0


def _chat(args: argparse.Namespace) -> int:
    """A chat session; Ctrl-C while the model answers stops that answer (the session goes on), Ctrl-C at the prompt
    or end of input ends the session."""
    from rooflm.entrypoints.args import engine_config_from_args
    from rooflm.entrypoints.streaming import stop_on_ctrl_c, stream_request
    from rooflm.llm import LLM

    params = _sampling_params(args)
    llm = LLM(**vars(engine_config_from_args(args)))
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": line})
        ids = llm.apply_chat_template(messages)
        print("model> ", end="", flush=True)
        with stop_on_ctrl_c() as stop:
            text = stream_request(llm.engine, ids, params, sys.stdout, stop)
        print(" [stopped]" if stop.is_set() else "", flush=True)
        messages.append({"role": "assistant", "content": text})
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rooflm.entrypoints.demo import run_demo

    return run_demo(args)
