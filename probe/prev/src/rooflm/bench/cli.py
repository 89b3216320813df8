"""``rooflm bench``: benchmarks, one sub-command each. Standard-library imports only at the top.

- ``serve``: load-test an OpenAI-compatible server over HTTP (``rooflm.bench.serving``);
- ``latency`` / ``throughput``: the offline engine benchmarks (``rooflm.bench.latency`` / ``.throughput``), listed
  only where those modules exist;
- ``perplexity``: the quality figure of a model and its quantization settings on a shipped text
  (``rooflm.bench.perplexity``); it always defaults to the embedded model, as random weights have no quality.

Each benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it is imported when its
sub-command runs, except that its ``add_arguments`` is needed to build the parser.

Defaults of the offline benchmarks depend on the machine: with a CUDA GPU, Llama-2-7B shapes with random fp16
weights (a model that fills a GPU); without one, the embedded SmolLM2-135M-Instruct in float32 with short
sequences, because 14 GB of random fp16 weights on a CPU take minutes to build and run for a figure of no use.
Options given on the command line always win, and a ``--model`` given as a path (a checkpoint folder or a GGUF file)
loads its own weights unless ``--load-format`` says otherwise.
"""
from __future__ import annotations

import argparse
import importlib
import os
import importlib.util
from typing import Any, Callable

_MACHINE_DEFAULTS = ("model", "load_format", "dtype", "input_len", "output_len")
_GPU_DEFAULTS = {"model": "llama-2-7b", "load_format": "dummy", "dtype": "float16"}
_CPU_DEFAULTS = {"load_format": "auto", "dtype": "float32", "input_len": 128, "output_len": 32}


def machine_defaults(has_gpu: bool) -> dict[str, Any]:
    """The offline benchmarks' defaults on this kind of machine (model None: the embedded default model)."""
    if has_gpu:
        return dict(_GPU_DEFAULTS)
    from rooflm.loader.default_model import default_model_path

    return {"model": default_model_path(), **_CPU_DEFAULTS}


def _with_machine_defaults(run: Callable[[argparse.Namespace], int], module_defaults: dict[str, Any]):
    def wrapped(args: argparse.Namespace) -> int:
        import torch

        chosen = machine_defaults(torch.cuda.is_available())
        if getattr(args, "model", None) is not None and os.path.exists(args.model):
            # a checkpoint given by path is benchmarked with its own weights, not the GPU default's random ones
            chosen["load_format"] = "auto"
        for name in _MACHINE_DEFAULTS:
            if getattr(args, name, "missing") is None:  # not given on the command line
                setattr(args, name, chosen.get(name, module_defaults.get(name)))
        return run(args)

    return wrapped

# (sub-command, module, help)
_BENCHMARKS = (
    ("latency", "rooflm.bench.latency", "latency of one batch: prefill and per-token decode time"),
    ("throughput", "rooflm.bench.throughput", "offline throughput of the engine on a batch of requests"),
    ("spec", "rooflm.bench.speculative", "speculative decoding against plain decoding on the same prompts"),
    ("multiturn", "rooflm.bench.multiturn", "multi-turn chat: TTFT with and without the prefix cache's host tier"),
    ("swap", "rooflm.bench.swap", "swap against recompute: the context length from which swapping a preempted KV wins"),
    ("serve", "rooflm.bench.serving", "load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput, goodput)"),
    ("perplexity", "rooflm.bench.perplexity", "perplexity on a text excerpt, per quantization setting"),
)
_OWN_DEFAULTS = ("serve", "perplexity")  # sub-commands without the machine-dependent defaults


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
        if name in _OWN_DEFAULTS:
            p.set_defaults(func=module.run)
            continue
        module_defaults = {k: p.get_default(k) for k in _MACHINE_DEFAULTS if p.get_default(k) is not None}
        p.set_defaults(**{k: None for k in module_defaults}, func=_with_machine_defaults(module.run, module_defaults))
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
