"""``rooflm bench``: benchmarks, one sub-command each. Standard-library imports only at the top.

- ``serve``: load-test an OpenAI-compatible server over HTTP (``rooflm.bench.serving``);
- ``latency`` / ``throughput``: the offline engine benchmarks (``rooflm.bench.latency`` / ``.throughput``), listed
  only where those modules exist.

Each benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it is imported when its
sub-command runs, except that its ``add_arguments`` is needed to build the parser.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util

# (sub-command, module, help)
_BENCHMARKS = (
    ("latency", "rooflm.bench.latency", "latency of one batch: prefill and per-token decode time"),
    ("throughput", "rooflm.bench.throughput", "offline throughput of the engine on a batch of requests"),
    ("spec", "rooflm.bench.speculative", "speculative decoding against plain decoding on the same prompts"),
    ("serve", "rooflm.bench.serving", "load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput, goodput)"),
)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(
        name for name, module, _ in _BENCHMARKS if _module_exists(module)),
        description="Benchmarks of rooflm and of OpenAI-compatible servers. See docs/serving.md.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for name, module_name, help_text in _BENCHMARKS:
        if not _module_exists(module_name):
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip().split("\n\n")[0])
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
