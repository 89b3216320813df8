"""``rooflm demo``: a few dozen varied prompts through continuous batching on the default model, one streamed to
the terminal, then a short report. All prompts share a system prompt, so the prefix cache has something to hit."""
from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rooflm.engine.stats import EngineStats

SYSTEM = ("You are a concise, friendly assistant. Answer in one or two sentences, plainly and accurately, "
          "without lists or headings.")

QUESTIONS = [
    "What is the capital of France?",
    "Explain what a black hole is to a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "Why is the sky blue?",
    "Give me a tip for learning a new language.",
    "What does a CPU do in a computer?",
    "Name three fruits that are rich in vitamin C.",
    "How do bees make honey?",
    "Suggest a name for a friendly robot.",
    "What is photosynthesis?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water at sea level?",
    "Describe the ocean in one sentence.",
    "Why do we have seasons on Earth?",
    "What is a prime number?",
    "Give me an idea for a short story.",
    "What is the largest planet in our solar system?",
    "How can I sleep better at night?",
    "Who wrote Pride and Prejudice?",
    "What is the difference between weather and climate?",
    "Tell me a fun fact about octopuses.",
    "What is machine learning, briefly?",
    "How many continents are there?",
    "What makes a good cup of tea?",
    "Why do cats purr?",
    "What is gravity?",
    "Recommend a hobby for a rainy day.",
    "What is the speed of light?",
    "How does a rainbow form?",
    "What is the tallest mountain on Earth?",
    "Write one sentence encouraging someone before an exam.",
    "What are clouds made of?",
]


def run_demo(args: argparse.Namespace) -> int:
    from rooflm.entrypoints.args import engine_config_from_args
    from rooflm.entrypoints.streaming import drive
    from rooflm.llm import LLM
    from rooflm.sampling_params import SamplingParams

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts={args.num_prompts} is invalid: expected an integer >= 1")
    llm = LLM(**vars(engine_config_from_args(args)))
    engine = llm.engine
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_prompts)]
    t0 = time.monotonic()
    ids = []
    for i, q in enumerate(questions):
        prompt = llm.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        # A varied mix: greedy, and seeded sampling at a few temperatures.
        params = SamplingParams(temperature=0.0) if i % 3 == 0 else SamplingParams(temperature=0.3 + 0.2 * (i % 3),
                                                                                  top_p=0.9, seed=i)
        params.max_tokens = args.max_tokens
        ids.append(engine.add_request(f"demo-{i}", prompt, params))
        if i == 0:  # the first request arrives alone; the others find the shared system prompt in the prefix cache
            engine.step()
    print(f"user> {questions[0]}\nmodel> ", end="", flush=True)
    finals = drive(engine, ids[0], sys.stdout)
    wall = time.monotonic() - t0
    print("\n")
    stats = engine.get_stats()
    outs = [finals[i] for i in ids]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    gen_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    tpots = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
             for o in outs if len(o.outputs[0].token_ids) > 1]
    for o in outs[1:4]:
        print(f"[{o.request_id}] {o.outputs[0].text.strip()[:160]!r}")
    from rooflm.units import duration, tok_rate

    rows = [
        ("requests", f"{len(outs)}"),
        ("prompt tokens", f"{prompt_tokens}"),
        ("generated tokens", f"{gen_tokens}"),
        ("wall time", duration(wall)),
        ("throughput", f"{tok_rate(gen_tokens / wall)} generated, {tok_rate((prompt_tokens + gen_tokens) / wall)} "
                       "total"),
        ("mean TTFT", duration(sum(ttfts) / len(ttfts))),
        ("mean TPOT", duration(sum(tpots) / max(len(tpots), 1))),
    ]
    print_report(rows, stats)
    return 0


def print_report(rows: list[tuple[str, str]], stats: "EngineStats") -> None:
    """The demo report: the request figures in ``rows``, then the engine's (prefix cache, KV blocks, preemptions,
    steps and, when measured, the live roofline)."""
    from rooflm.roofline.live import roofline_line, roofline_summary

    rows = rows + [
        ("prefix-cache hit rate", f"{100 * stats.prefix_cache_hit_rate:.1f}% of prompt tokens"),
        ("peak KV blocks used", f"{stats.peak_blocks_used} of {stats.num_total_blocks}"),
        ("preemptions", f"{stats.num_preemptions}"),
        ("engine steps", f"{stats.num_steps}"),
    ]
    line = roofline_line(roofline_summary(stats))
    if line:
        rows.append(("roofline", line.removeprefix("roofline: ")))
    print("\n== rooflm demo report ==")
    for k, v in rows:
        print(f"  {k:<22} {v}")
