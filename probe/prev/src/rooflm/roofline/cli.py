"""``rooflm analyze``: roofline analysis from the command line. Standard-library imports only at the top level (the
``rooflm`` command imports this module to build its parser); the analyzer is pure Python and starts fast, matplotlib
and torch load only for ``--plot`` and ``--measure``."""
from __future__ import annotations

import argparse
import sys

BITS_HELP = "32, 16, bf16, 8 (int8), fp8 or 4 (int4)"


def _int_list(field: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{field}={text!r} is invalid: expected an integer >= 1 or a comma-separated list (1,2,4)")
    return values


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "analyze", help="roofline analysis: per-operator OPs, bytes, bound and best time; memory; latency",
        description="Roofline analysis of a model on a device (LLM-Viewer of Yuan et al. 2024, corrected). Comma lists in "
                    "--batch, --input-len and --w-bits make a sweep, printed as one table. See docs/roofline.md.")
    p.add_argument("model", nargs="?", help="named config (llama-2-7b, ...), config.json, checkpoint folder or .gguf")
    p.add_argument("--hardware", default="a6000", help="device from the catalog (see --list-hardware); default a6000")
    p.add_argument("--batch", default="1", help="batch size, or a comma list for a sweep (default 1)")
    p.add_argument("--input-len", default="2048", help="prompt tokens, or a comma list (default 2048)")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens (default 256)")
    p.add_argument("--decode-context", type=int, default=None,
                   help="context of the reported decode step (default: --input-len, as in Table 1 of Yuan et al. 2024)")
    p.add_argument("--w-bits", default="16", help=f"weight bits: {BITS_HELP}; a comma list sweeps (default 16)")
    p.add_argument("--a-bits", default="16", help=f"activation bits: {BITS_HELP} (default 16)")
    p.add_argument("--kv-bits", default="16", help=f"KV-cache bits: {BITS_HELP} (default 16)")
    p.add_argument("--flash-attention", action="store_true", help="one fused attention operator")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (figures per GPU; default 1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tp: a mixture-of-experts model's experts split whole over the GPUs")
    p.add_argument("--logits", choices=("all", "last"), default="all",
                   help="prefill lm_head on all prompt tokens (transformers) or the last only (vLLM); default all")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE", help="write JSON (to stdout without FILE)")
    p.add_argument("--csv", nargs="?", const="-", metavar="FILE", help="write CSV (to stdout without FILE)")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots (roofline, time breakdown, sweep) into DIR")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    p.add_argument("--measure", action="store_true",
                   help="measure this machine's memory bandwidth and matmul peak (torch) and use them")
    p.add_argument("--device-file", metavar="FILE", help="JSON/YAML file adding devices to the catalog")
    p.add_argument("--list-hardware", action="store_true", help="list the device catalog and exit")
    p.add_argument("--speculative-tokens", type=int, default=None, metavar="K",
                   help="also predict speculative decoding's speed-up with K draft tokens per step (16-bit weights)")
    p.add_argument("--acceptance", type=float, default=0.7,
                   help="with --speculative-tokens: probability a draft token is accepted (default 0.7)")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="with --speculative-tokens: the drafts come from this model's k decode steps (draft_model)")
    p.add_argument("--draft-layers", type=int, default=None, metavar="N",
                   help="with --speculative-tokens: the drafts come from the model's first N layers (self)")
    p.set_defaults(func=run)


def _write(target: str, text: str) -> None:
    if target == "-":
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        with open(target, "w") as f:
            f.write(text)
        print(f"wrote {target}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from rooflm.roofline.hardware import builtin_catalog, get_hardware, load_device_file

    if args.list_hardware:
        cat = builtin_catalog()
        if args.device_file:
            cat.devices.update(load_device_file(args.device_file))
        for key in sorted(cat.devices):
            e = cat.devices[key]
            peaks = ", ".join(f"{k} {v:g}" for k, v in e["peak_tflops"].items())
            print(f"{key:12s} {e.get('name', key)}: {e['memory_bandwidth_gbs']:g} GB/s, {e['memory_gib']:g} GiB, "
                  f"TFLOP/s {peaks}")
        return 0
    if not args.model:
        raise ValueError("model is missing: expected a named config (e.g. llama-2-7b), a config.json, a checkpoint "
                         "folder or a .gguf file")
    if args.json == "-" and args.csv == "-":
        raise ValueError("--json and --csv both to stdout: only one format can go there; give the other a file")
    batches = _int_list("batch", args.batch)
    input_lens = _int_list("input_len", args.input_len)
    w_bits_list = [w.strip() for w in str(args.w_bits).split(",") if w.strip()]

    if args.measure:
        from rooflm.roofline.measure import measure_hardware

        hw = measure_hardware()
        from rooflm.units import bandwidth, flop_rate

        print(f"{hw.name}: {bandwidth(hw.memory_bandwidth)}, "
              + ", ".join(f"{k} {flop_rate(v)}" for k, v in hw.peak_ops.items()), file=sys.stderr)
    else:
        hw = get_hardware(args.hardware, args.device_file)

    from rooflm.roofline.analyzer import sweep
    from rooflm.roofline import report

    options = dict(output_len=args.output_len, a_bits=args.a_bits, kv_bits=args.kv_bits,
                   flash_attention=args.flash_attention, tp=args.tp, decode_context=args.decode_context,
                   prefill_logits=args.logits, expert_parallel=args.enable_expert_parallel)
    results = sweep(args.model, hw, batches=batches, input_lens=input_lens, w_bits_list=w_bits_list, **options)

    to_stdout = args.json == "-" or args.csv == "-"
    if not to_stdout:
        print(report.text_report(results[0]) if len(results) == 1 else report.sweep_table(results))
    if args.json:
        _write(args.json, report.to_json(results))
    if args.csv:
        _write(args.csv, report.to_csv(results))
    if args.plot:
        from rooflm.roofline.plot import write_plots

        sweep_x = "input_len" if len(input_lens) > 1 and len(batches) == 1 else "batch"
        for path in write_plots(results, args.plot, sweep_x=sweep_x, model=args.model):
            print(f"wrote {path}", file=sys.stderr)
    if args.html:
        from rooflm.roofline.html import html_report

        _write(args.html, html_report(results))
    if args.speculative_tokens is not None:
        for line in speculative_lines(args.model, hw, batches, args.decode_context or input_lens[0],
                                      args.speculative_tokens, args.acceptance, args.tp,
                                      getattr(args, "draft_model", None), getattr(args, "draft_layers", None)):
            print(line, file=sys.stderr if to_stdout else sys.stdout)
    return 0


def speculative_lines(model: str, hw, batches: list[int], context: int, k: int, acceptance: float,
                      tp: int = 1, draft_model: str | None = None, draft_layers: int | None = None) -> list[str]:
    """Speculative decoding on the roofline: a verify step of k + 1 tokens per request against a decode step of one,
    at ``context`` tokens, and the speed-up at ``acceptance`` (tokens per verification (1 - a^(k+1)) / (1 - a),
    Leviathan et al. 2023). With ``draft_model`` (a second model) or ``draft_layers`` (the model's first layers, its
    norm and LM head) the k single-token draft steps are added to the verify step's time."""
    import dataclasses

    from rooflm.config import load_model_config
    from rooflm.roofline.live import LiveRoofline
    from rooflm.spec_decode.proposer import expected_tokens

    if not isinstance(k, int) or k < 1:
        raise ValueError(f"--speculative-tokens={k!r} is invalid: expected a positive integer")
    if not 0 <= acceptance <= 1:
        raise ValueError(f"--acceptance={acceptance!r} is invalid: expected a probability in [0, 1]")
    cfg = load_model_config(model)
    live = LiveRoofline(cfg, "float16", hw, tp=tp)
    if draft_model is not None and draft_layers is not None:
        raise ValueError("--draft-model and --draft-layers are two different drafts: give one")
    draft = None
    if draft_model is not None:
        draft = LiveRoofline(load_model_config(draft_model), "float16", hw, tp=tp)
    elif draft_layers is not None:
        if not isinstance(draft_layers, int) or not 1 <= draft_layers < cfg.num_hidden_layers:
            raise ValueError(f"--draft-layers={draft_layers!r} is invalid: expected 1 to {cfg.num_hidden_layers - 1}")
        draft = LiveRoofline(dataclasses.replace(cfg, num_hidden_layers=draft_layers), "float16", hw, tp=tp)
    lines = []
    for b in batches:
        plain = live.predict([1] * b, [context + 1] * b, b)
        verify = live.predict([k + 1] * b, [context + k + 1] * b, b * (k + 1))
        tokens = expected_tokens(k, acceptance)
        drafting = sum(draft.predict([1] * b, [context + 1 + j] * b, b) for j in range(k)) if draft else 0.0
        extra = f" + {k} draft steps {drafting * 1e3:.3f} ms" if draft else ""
        lines.append(f"speculative decoding, batch {b}, k={k}, acceptance {acceptance:g}: a verify step takes "
                     f"{verify * 1e3:.3f} ms = {verify / plain:.3f}x a decode step ({plain * 1e3:.3f} ms){extra}; "
                     f"{tokens:.2f} tokens per verification: predicted speed-up "
                     f"{tokens * plain / (verify + drafting):.2f}x")
    return lines
