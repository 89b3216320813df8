"""Perplexity of a model on a fixed text excerpt, computed through the engine: the quality figure of a quantization
scheme (weights and KV cache), to set beside its speed.

``rooflm bench perplexity --max-tokens 4096 --window 1024 --compare none,w8a16,w4a16``

Method. The text (by default chapters 1-12 of Jane Austen's *Pride and Prejudice*, 1813, shipped in
``bench/data/``) is tokenized as plain text, without special tokens, and cut to its first ``--max-tokens`` tokens:
the excerpt. The excerpt is split into windows of ``--window`` tokens that start every ``--stride`` tokens (the
"sliding window with a stride" of Hugging Face's perplexity guide). By default the stride equals the window: the
windows do not overlap, and every token but the first of each window is scored, with the tokens before it in its
window as context. With a stride S < W, window k spans ``[k*S, k*S + W)`` and scores only the tokens that the
previous window did not reach, so every scored token has at least ``W - S`` tokens of context, at the cost of
about W / S times the compute. Each excerpt token after the first is scored exactly once, wherever it falls.

Each window is one engine request, ``SamplingParams(max_tokens=1, prompt_logprobs=0)``: the engine returns log
P(token_p | tokens before p in the window) for every prompt position p (the actual token's logprob is always
present, whatever k). Perplexity = exp(-mean logprob) over the scored tokens. The windows are prefilled in chunks
of ``--max-num-batched-tokens`` tokens, so every chunk after the first reads the earlier chunks' keys and values
back from the paged KV cache, as decoding does: a quantized KV cache (``--kv-cache-dtype``) changes the figure as
it changes generation, whatever the attention kernel. (rooflm's backends also read a chunk's own keys back from the
cache, but a prefill kernel that takes the new keys and values as inputs attends to the fresh, unquantized ones, and
a window prefilled in one step would then hide the KV cache's error.)

``--quantization`` / ``--kv-cache-dtype`` are handed to the engine only when given; ``--compare`` evaluates several
settings (``QUANT`` or ``QUANT:KV_DTYPE``) one after the other in one run and prints each one's ratio to the first.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from rooflm.bench.output import add_output_args, check_output_args, report_stream, write_outputs

DEFAULT_TEXT = "austen_pride_and_prejudice.txt"
# The engine's option for each pass-through flag, and the value that means "as an engine without the option".
_PASS_THROUGH = {"quantization": ("--quantization", "none"), "kv_cache_dtype": ("--kv-cache-dtype", "auto")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint folder or .gguf (default: the embedded SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default="auto", help="auto (default: float32 on the CPU, bfloat16 on CUDA), float16, bfloat16, "
                                                   "float32")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="UTF-8 text to score (default: Pride and Prejudice, chapters 1-12, shipped with rooflm)")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="the excerpt: the first N tokens of the text after tokenization (default 4096)")
    p.add_argument("--window", type=int, default=1024,
                   help="tokens per evaluated window, its own context included (default 1024)")
    p.add_argument("--stride", type=int, default=None,
                   help="start a window every STRIDE tokens (default: the window, i.e. non-overlapping windows); "
                        "a smaller stride scores only each window's last STRIDE tokens, with more context")
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="token budget of one engine step (default 256): a longer window is prefilled in chunks, and "
                        "each chunk reads the earlier chunks' keys/values back from the paged KV cache, which is "
                        "what makes a quantized KV cache (--kv-cache-dtype) show in the perplexity")
    p.add_argument("--quantization", default=None,
                   help="weight quantization handed to the engine (e.g. none, w8a16, w4a16, gptq, awq, gguf, fp8); "
                        "left to the engine's default when not given")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="KV cache dtype handed to the engine (e.g. auto, int8, fp8); the engine's default when not "
                        "given")
    p.add_argument("--compare", default=None, metavar="A,B,...",
                   help="evaluate several settings in one run and print a table with each one's ratio to the first: "
                        "comma-separated QUANT or QUANT:KV_DTYPE, e.g. none,w8a16,w4a16 or none,none:int8")
    p.add_argument("--kv-budgets", default=None, metavar="B,B,...",
                   help="compare StreamingLLM KV compression budgets (tokens kept per request, 4 sink tokens; 0 = "
                        "full attention), e.g. 0,256,512,1024; use with a small --max-num-batched-tokens so each "
                        "scored token sees close to the whole budget (default: off)")
    p.add_argument("--kv-methods", default="streaming", metavar="M,M,...",
                   help="with --kv-budgets: the compression methods to evaluate at each budget, streaming "
                        "(StreamingLLM) and/or h2o (H2O: the recent half of the budget plus the blocks with the "
                        "largest accumulated attention scores) (default: streaming)")
    add_output_args(p)


# ---------------------------------------------------------------------------------------------------------------------
# The computation
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    begin: int  # first excerpt token of the window (its context starts here)
    end: int  # one past its last token
    first_scored: int  # the window scores excerpt tokens [first_scored, end)


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    num_tokens: int  # excerpt length
    num_scored: int
    num_windows: int
    window: int
    stride: int
    token_logprobs: list[float] = field(default_factory=list, repr=False)  # one per scored token, in text order


def plan_windows(num_tokens: int, window: int, stride: int | None = None) -> list[Window]:
    """The windows over ``num_tokens`` tokens: starts 0, S, 2S, ...; window k scores the tokens after the previous
    window's end (and never its own first token, which has no context). Every token 1..num_tokens-1 is scored once."""
    stride = window if stride is None else stride
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window={window!r} is invalid: expected an integer >= 2 (one context token and one scored)")
    if not isinstance(stride, int) or not 1 <= stride <= window:
        raise ValueError(f"stride={stride!r} is invalid: expected an integer in [1, window={window}]")
    if not isinstance(num_tokens, int) or num_tokens < 2:
        raise ValueError(f"num_tokens={num_tokens!r} is invalid: expected at least 2 tokens to score one")
    out: list[Window] = []
    prev_end = 0
    begin = 0
    while prev_end < num_tokens:
        end = min(begin + window, num_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append(Window(begin, end, first))
        prev_end = end
        begin += stride
    return out


def perplexity(llm: Any, token_ids: list[int], window: int, stride: int | None = None) -> PerplexityResult:
    """Perplexity of ``llm`` (a ``rooflm.LLM``) on ``token_ids``, windowed as ``plan_windows`` says; every window is
    one request, all submitted together so the engine batches them."""
    from rooflm.sampling_params import SamplingParams

    token_ids = list(token_ids)
    windows = plan_windows(len(token_ids), window, stride)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate([token_ids[w.begin:w.end] for w in windows], params, use_tqdm=False)
    logprobs: list[float] = []
    for w, out in zip(windows, outs):
        plp = out.prompt_logprobs
        if plp is None or len(plp) != w.end - w.begin:
            raise RuntimeError(f"the engine returned {None if plp is None else len(plp)} prompt logprobs for a window "
                               f"of {w.end - w.begin} tokens")
        for p in range(w.first_scored, w.end):
            entry = plp[p - w.begin]
            if entry is None or token_ids[p] not in entry:
                raise RuntimeError(f"the engine returned no logprob for prompt token {token_ids[p]} at position "
                                   f"{p - w.begin} of window [{w.begin}, {w.end})")
            logprobs.append(float(entry[token_ids[p]]))
    mean_nll = -math.fsum(logprobs) / len(logprobs)
    return PerplexityResult(perplexity=math.exp(mean_nll), mean_nll=mean_nll, num_tokens=len(token_ids),
                            num_scored=len(logprobs), num_windows=len(windows), window=window,
                            stride=window if stride is None else stride, token_logprobs=logprobs)


def load_text(path: str | None = None) -> str:
    """The text to score: a UTF-8 file, or the excerpt shipped with rooflm."""
    if path is None:
        return (resources.files("rooflm.bench") / "data" / DEFAULT_TEXT).read_text(encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        return f.read()


def excerpt_tokens(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` tokens of ``text`` tokenized as plain text (no BOS or other special tokens)."""
    if not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens!r} is invalid: expected an integer >= 2")
    if tokenizer is None:
        raise ValueError("this model has no tokenizer (a named config or dummy weights): perplexity needs a real "
                         "checkpoint and its tokenizer")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s): at least 2 are needed to score one")
    return ids


# ---------------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------------
def parse_compare(spec: str, kv_cache_dtype: str | None = None) -> list[tuple[str, str | None]]:
    """``"none,w8a16,w4a16:int8"`` -> [(quantization, kv_cache_dtype), ...]; an entry without ``:KV`` takes
    ``kv_cache_dtype`` (None: the engine's default)."""
    settings = []
    for entry in spec.split(","):
        quant, _, kv = entry.strip().partition(":")
        if not quant or (_ and not kv):
            raise ValueError(f"compare={spec!r} is invalid: entry {entry!r} is not QUANT or QUANT:KV_DTYPE")
        settings.append((quant, kv or kv_cache_dtype))
    if len(settings) < 2:
        raise ValueError(f"compare={spec!r} is invalid: expected at least two comma-separated settings")
    return settings


def engine_options(quantization: str | None, kv_cache_dtype: str | None) -> dict[str, str]:
    """The pass-through options for ``LLM(...)``: only those given. Where this engine has no such option, the value
    meaning "unquantized" is dropped (it is what the engine does anyway) and any other is a ValueError naming the
    flag."""
    from rooflm.config import EngineConfig

    fields = EngineConfig.__dataclass_fields__
    out = {}
    for name, value in (("quantization", quantization), ("kv_cache_dtype", kv_cache_dtype)):
        if value is None:
            continue
        flag, plain = _PASS_THROUGH[name]
        if name not in fields:
            if value == plain:
                continue
            raise ValueError(f"{flag} {value}: this rooflm's engine has no {name!r} option (EngineConfig fields: "
                             f"{sorted(fields)})")
        out[name] = value
    return out


def parse_budgets(spec: str) -> list[int]:
    """``"0,256,512"`` -> [0, 256, 512]; 0 is full attention."""
    try:
        budgets = [int(b) for b in spec.split(",")]
    except ValueError:
        raise ValueError(f"--kv-budgets {spec!r} is invalid: expected comma-separated integers >= 0") from None
    if not budgets or any(b < 0 for b in budgets):
        raise ValueError(f"--kv-budgets {spec!r} is invalid: expected comma-separated integers >= 0")
    return budgets


def parse_methods(spec: str) -> list[str]:
    """``"streaming,h2o"`` -> ["streaming", "h2o"]."""
    from rooflm.kv_cache.compression import COMPRESSION_METHODS

    methods = [m.strip() for m in spec.split(",")]
    if not methods or any(m not in COMPRESSION_METHODS for m in methods):
        raise ValueError(f"--kv-methods {spec!r} is invalid: expected comma-separated methods of {COMPRESSION_METHODS}")
    return methods


def _setting_name(quantization: str | None, kv_cache_dtype: str | None, budget: int | None = None,
                  method: str = "streaming") -> str:
    name = quantization or "default"
    name = f"{name}:{kv_cache_dtype}" if kv_cache_dtype else name
    if budget is not None:
        name += f" {method}:{budget}" if budget else " full attention"
    return name


def _evaluate_setting(args: argparse.Namespace, text: str, quantization: str | None,
                      kv_cache_dtype: str | None, budget: int | None = None,
                      method: str = "streaming") -> tuple[dict, Any]:
    import torch

    from rooflm.llm import LLM

    options: dict[str, Any] = engine_options(quantization, kv_cache_dtype)
    if budget:
        options["kv_compression"] = ({"method": "streaming", "budget": budget, "sink": 4} if method == "streaming"
                                     else {"method": method, "budget": budget})
    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.window + 1,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                  show_progress=False, **options)
    except ValueError as e:  # name the flags behind the engine's option names
        given = " ".join(f"{_PASS_THROUGH[k][0]} {v}" for k, v in options.items())
        hint = f" (--window {args.window} needs max_model_len={args.window + 1})" if "max_model_len" in str(e) else ""
        raise ValueError(f"{given + ': ' if given else ''}{e}{hint}") from e
    load_s = time.perf_counter() - t0
    ids = excerpt_tokens(llm.get_tokenizer(), text, args.max_tokens)
    t0 = time.perf_counter()
    r = perplexity(llm, ids, args.window, args.stride)
    eval_s = time.perf_counter() - t0
    engine = llm.engine
    row = {"setting": _setting_name(quantization, kv_cache_dtype, budget, method), "quantization": quantization,
           "kv_budget": budget, "kv_method": method if budget else None,
           "kv_cache_dtype": kv_cache_dtype, "perplexity": r.perplexity, "mean_nll": r.mean_nll,
           "num_tokens": r.num_tokens, "num_scored": r.num_scored, "num_windows": r.num_windows,
           "load_s": load_s, "eval_s": eval_s, "device": str(engine.device),
           "dtype": str(engine.dtype).removeprefix("torch.")}
    del llm, engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, r


def run(args: argparse.Namespace) -> int:
    if args.compare and (args.quantization is not None):
        raise ValueError("--compare and --quantization are exclusive: list every setting in --compare")
    if not isinstance(args.max_num_batched_tokens, int) or args.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens {args.max_num_batched_tokens} is invalid: expected >= 1")
    if not isinstance(args.max_tokens, int) or args.max_tokens < 2:
        raise ValueError(f"--max-tokens {args.max_tokens} is invalid: expected >= 2 (one context token, one scored)")
    check_output_args(args)
    plan_windows(args.max_tokens, args.window, args.stride)  # check the flags before loading anything
    settings = (parse_compare(args.compare, args.kv_cache_dtype) if args.compare
                else [(args.quantization, args.kv_cache_dtype)])
    budgets = parse_budgets(args.kv_budgets) if getattr(args, "kv_budgets", None) else [None]
    methods = parse_methods(getattr(args, "kv_methods", None) or "streaming")
    if args.compare and budgets != [None]:
        raise ValueError("--compare and --kv-budgets are exclusive: compare one of them at a time")
    for q, kv in settings:  # an option the engine lacks fails now, not after the first setting's run
        engine_options(q, kv)
    text = load_text(args.text)
    rows = []
    for (q, kv), b, m in [(s, b, m) for s in settings for b in budgets for m in (methods if b else methods[:1])]:
        row, _ = _evaluate_setting(args, text, q, kv, b, m)
        row["ratio"] = row["perplexity"] / rows[0]["perplexity"] if rows else 1.0
        rows.append(row)
    res = {"command": "rooflm bench perplexity " + " ".join(sys.argv[3:])
           if sys.argv[1:3] == ["bench", "perplexity"] else "",
           "model": args.model or "default (SmolLM2-135M-Instruct GGUF)", "text": args.text or DEFAULT_TEXT,
           "max_tokens": args.max_tokens, "window": args.window, "stride": args.stride or args.window,
           "max_num_batched_tokens": args.max_num_batched_tokens,
           "kv_budgets": getattr(args, "kv_budgets", None), "results": rows}
    with report_stream(args):
        _print(res)
    common = {k: res[k] for k in ("model", "text", "max_tokens", "window", "stride", "max_num_batched_tokens")}
    write_outputs(args, res, rows=[{**common, **row} for row in rows])  # CSV: one row per setting
    return 0


def _print(res: dict) -> None:
    rows = res["results"]
    first = rows[0]
    print(f"rooflm bench perplexity: {res['model']} {first['dtype']} on {first['device']}; {res['text']}: "
          f"{first['num_tokens']} tokens, windows of {res['window']} every {res['stride']}, prefill chunks of "
          f"{res['max_num_batched_tokens']}")
    if len(rows) == 1:
        print(f"  perplexity {first['perplexity']:.4f} (mean NLL {first['mean_nll']:.4f} nats) over "
              f"{first['num_scored']} tokens in {first['num_windows']} windows; load {first['load_s']:.1f} s, "
              f"evaluation {first['eval_s']:.1f} s")
        return
    width = max(len("setting"), *(len(r["setting"]) for r in rows))
    print(f"  {'setting':<{width}}  {'perplexity':>10}  {'ratio':>7}  {'load s':>7}  {'eval s':>7}")
    for r in rows:
        print(f"  {r['setting']:<{width}}  {r['perplexity']:>10.4f}  {r['ratio']:>7.4f}  {r['load_s']:>7.1f}  "
              f"{r['eval_s']:>7.1f}")
    print(f"  ({first['num_scored']} scored tokens in {first['num_windows']} windows each)")


__all__ = ["PerplexityResult", "Window", "engine_options", "excerpt_tokens", "load_text", "parse_compare",
           "perplexity", "plan_windows", "add_arguments", "run"]
