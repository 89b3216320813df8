"""``rooflm generate``, ``rooflm chat`` and ``rooflm demo``."""
from __future__ import annotations

import argparse
import sys

from rooflm.entrypoints.args import add_engine_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete prompts with continuous batching")
    add_engine_args(p)
    _add_sampling_args(p)
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.set_defaults(func=_generate)

    p = sub.add_parser("chat", help="chat interactively with the model (tokens stream as they come)")
    add_engine_args(p)
    _add_sampling_args(p, max_tokens=256, temperature=0.7)
    p.add_argument("--system", default=None, help="a system prompt")
    p.set_defaults(func=_chat)

    p = sub.add_parser("demo", help="a few dozen prompts through continuous batching, one streamed, then a report")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=_demo)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 64, temperature: float = 0.0) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=temperature)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--sample-seed", dest="sampling_seed", type=int, default=None,
                   help="seed of each request's sampling (--seed seeds the engine)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--repetition-penalty", type=float, default=1.0)


def _sampling_params(args: argparse.Namespace):
    from rooflm.sampling_params import SamplingParams

    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, max_tokens=args.max_tokens, seed=args.sampling_seed, stop=args.stop,
                          repetition_penalty=args.repetition_penalty)


def _generate(args: argparse.Namespace) -> int:
    from rooflm.entrypoints.args import engine_config_from_args
    from rooflm.llm import LLM

    params = _sampling_params(args)
    config = engine_config_from_args(args)
    llm = LLM(**{k: v for k, v in vars(config).items()})
    for out in llm.generate(args.prompts, params):
        for c in out.outputs:
            tag = f"[{out.request_id}]" if params.n == 1 else f"[{out.request_id}.{c.index}]"
            print(f"{tag} {out.prompt!r} -> {c.text!r} ({c.finish_reason}, {len(c.token_ids)} tokens)")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from rooflm.entrypoints.args import engine_config_from_args
    from rooflm.entrypoints.streaming import stream_request
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
        text = stream_request(llm.engine, ids, params, sys.stdout)
        print(flush=True)
        messages.append({"role": "assistant", "content": text})
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rooflm.entrypoints.demo import run_demo

    return run_demo(args)
