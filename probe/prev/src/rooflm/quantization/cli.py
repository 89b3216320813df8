"""``rooflm quantize``: quantize a model's projections with round-to-nearest, GPTQ or AWQ and write a Hugging Face
GPTQ or AWQ checkpoint folder. Standard-library imports only at the top (``rooflm --help`` stays fast)."""
from __future__ import annotations

import argparse
import json
import os


def _positive(flag: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not an integer") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} {v} must be at least 1")
        return v
    return parse


def _group_size(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--group-size {text!r} is not an integer") from None
    if v < 1 and v != -1:
        raise argparse.ArgumentTypeError(f"--group-size {v} must be a positive integer or -1 (per channel)")
    return v


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="quantize a model (RTN, GPTQ or AWQ) into a GPTQ / AWQ checkpoint folder",
                       description="Quantize every decoder projection of MODEL and write a Hugging Face checkpoint "
                                   "folder in the GPTQ or AWQ format. GPTQ and AWQ calibrate on a text (default: a "
                                   "public-domain King James Bible excerpt shipped with rooflm).")
    p.add_argument("model", metavar="MODEL", help="a HF checkpoint folder, a .gguf file (dequantized to float first) "
                                                  "or a named config (random weights)")
    p.add_argument("--method", choices=("rtn", "awq", "gptq"), default="gptq",
                   help="rtn (round to nearest), awq (Lin et al. 2024) or gptq (Frantar et al. 2023)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4, help="bits per weight")
    p.add_argument("--group-size", type=_group_size, default=None,
                   help="input columns per scale (default: 128, or the largest power of two below it that divides "
                        "every projection); -1: one scale per output channel")
    p.add_argument("--desc-act", action="store_true", help="GPTQ act-order: quantize columns by decreasing Hessian "
                                                            "diagonal")
    p.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=None,
                   help="gptq: calibrate layer by layer, each layer from the outputs of the already quantized ones, "
                        "as published; --no-sequential (the default) takes every layer's statistics from the float "
                        "model in one pass (measured as good with --desc-act on the default model)")
    p.add_argument("--no-grid-search", dest="grid_search", action="store_false",
                   help="rtn / gptq: take each group's scale and zero point from its min and max (faster) instead of "
                        "searching the pair with the smallest squared error")
    p.add_argument("--calib", default=None, metavar="FILE", nargs="+",
                   help="calibration text file(s), joined in order (default: the shipped King James Bible excerpt); "
                        "text like what the model will be used on calibrates best")
    p.add_argument("--num-samples", type=_positive("--num-samples"), default=16, help="calibration windows")
    p.add_argument("--seq-len", type=_positive("--seq-len"), default=256, help="tokens per calibration window")
    p.add_argument("--format", dest="fmt", choices=("gptq", "awq"), default=None,
                   help="checkpoint layout (default: awq for --method awq, else gptq)")
    p.add_argument("--checkpoint-format", choices=("gptq", "gptq_v2"), default="gptq",
                   help="GPTQ zero-point convention: gptq stores z - 1 (what every loader reads), gptq_v2 stores z")
    p.add_argument("--threads", type=_positive("--threads"), default=None,
                   help="CPU threads (default: the cores the 1-minute load average leaves idle, at least 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of random weights (named configs) and of the calibration's row sampling")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the quantized checkpoint to")
    p.set_defaults(func=_quantize)


def idle_cores() -> int:
    """Cores not busy with other processes, by the 1-minute load average (at least 1). OpenMP threads that share
    a core with another process wait for each other at every op: on a busy machine, fewer threads run faster."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cores
    return max(1, min(cores, int(cores - load + 0.5)))


def check_args(args: argparse.Namespace) -> str:
    """The checkpoint layout to write; ValueError naming the flag for a combination that cannot be written."""
    fmt = args.fmt or ("awq" if args.method == "awq" else "gptq")
    if fmt == "awq" and args.bits != 4:
        raise ValueError(f"--bits {args.bits}: the AWQ format holds 4-bit weights only (use --format gptq)")
    if args.desc_act and args.method != "gptq":
        raise ValueError(f"--desc-act is GPTQ's act-order: it does not apply to --method {args.method}")
    if args.sequential is not None and args.method != "gptq":
        flag = "--sequential" if args.sequential else "--no-sequential"
        raise ValueError(f"{flag} chooses GPTQ's calibration order: it does not apply to --method {args.method}")
    if args.desc_act and fmt == "awq":
        raise ValueError("--desc-act: the AWQ format has no g_idx (use --format gptq)")
    if args.calib is not None and args.method == "rtn":
        raise ValueError(f"--calib {' '.join(args.calib)}: --method rtn uses no calibration data")
    for path in args.calib or ():
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--calib {path}: no such file")
    config = os.path.join(args.model, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            quant = json.load(f).get("quantization_config")
        if quant:
            raise ValueError(f"MODEL {args.model} is already quantized (quantization_config.quant_method="
                             f"{quant.get('quant_method')!r}): quantize a float checkpoint")
    return fmt


def _quantize(args: argparse.Namespace) -> int:
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    fmt = check_args(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or idle_cores())
    try:
        return _run(args, fmt)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, fmt: str) -> int:
    import sys
    import time

    import torch

    from rooflm.loader import load_model, resolve_model
    from rooflm.quantization.calibration import (
        calibration_windows, decoder_linears, read_calibration_text, tokenize_calibration,
    )
    from rooflm.quantization.checkpoint import save_quantized_checkpoint
    from rooflm.quantization.pipeline import QuantizeConfig, quantize_model, resolve_group_size
    from rooflm.tokenizer import load_tokenizer

    start = time.perf_counter()
    path, source = resolve_model(args.model)
    # a GGUF file is dequantized to float first (loading it keeps its blocks packed by default)
    model, cfg = load_model(args.model, dtype=torch.float32, device="cpu", attn_backend="torch", ops="native",
                            seed=args.seed, show_progress=False, quantization="none" if source == "gguf" else None)
    try:
        resolve_group_size(args.group_size, {n: m.in_features for n, m in decoder_linears(model).items()})
    except ValueError as e:
        raise ValueError(f"--group-size {args.group_size}: {e}") from None
    qcfg = QuantizeConfig(method=args.method, bits=args.bits, group_size=args.group_size, desc_act=args.desc_act,
                          num_samples=args.num_samples, seq_len=args.seq_len, seed=args.seed,
                          search_grid=args.grid_search, sequential=args.sequential,
                          min_zero=1 if fmt == "gptq" and args.checkpoint_format == "gptq" else 0)
    tokenizer = None if source == "dummy" else load_tokenizer(path)
    windows = None
    if qcfg.needs_calibration:
        text = "\n\n".join(read_calibration_text(f) for f in args.calib) if args.calib else read_calibration_text()
        ids = tokenize_calibration(text, tokenizer, cfg.vocab_size)
        try:
            windows = calibration_windows(ids, args.num_samples, args.seq_len)
        except ValueError as e:
            raise ValueError(f"--seq-len {args.seq_len}: {e}") from None
    loaded = time.perf_counter()
    result = quantize_model(model, cfg, qcfg, windows)
    quantized = time.perf_counter()
    hf_config = dict(cfg.hf_config)
    hf_config.setdefault("architectures", [cfg.architecture])
    hf_config.setdefault("model_type", cfg.model_type)
    out = save_quantized_checkpoint(args.out, result.float_state, result.quantized, hf_config, args.method,
                                    args.bits, result.group_size, args.desc_act, fmt, args.checkpoint_format,
                                    tokenizer_source=None if source == "dummy" else path)
    done = time.perf_counter()
    print(f"rooflm quantize: {len(result.quantized)} projections, {args.method} {args.bits}-bit, group size "
          f"{result.group_size}, {fmt} format -> {os.path.dirname(out) or '.'} (load {loaded - start:.1f} s, "
          f"quantize {quantized - loaded:.1f} s, write {done - quantized:.1f} s, {torch.get_num_threads()} threads)",
          file=sys.stderr)
    return 0
