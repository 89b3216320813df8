"""``rooflm train-medusa``: train Medusa-1 heads on a frozen model and save them for
``speculative_config={"method": "medusa", "model": DIR}`` (see ``rooflm.spec_decode.medusa_train``)."""
from __future__ import annotations

import argparse
import re


def _positive(flag: str, kind=int):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not a {kind.__name__}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} must be positive")
        return v

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-medusa", help="train Medusa decoding heads on a frozen model (speculative decoding)",
                       description="Train Medusa-1 heads (Cai et al. 2024) on a frozen model: head i learns token "
                                   "t + i + 1 from the model's last hidden state at t, through the model's own LM "
                                   "head. Prints the loss every --log-every steps and each head's top-1 accuracy on "
                                   "held-out text, and writes the heads to --out.")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct (GGUF)")
    p.add_argument("--load-format", default="auto", help="auto, safetensors, gguf, dummy (random weights)")
    p.add_argument("--quantization", default=None,
                   help="none | w8a16 | w4a16 | gguf | ... (default: what the checkpoint holds, as when serving)")
    p.add_argument("--data", default=None, metavar="TEXT",
                   help="training text file (default: the shipped excerpt of Austen's Emma)")
    p.add_argument("--eval-data", default=None, metavar="TEXT",
                   help="held-out text file for the accuracy report (default: the shipped Pride and Prejudice "
                        "excerpt, which `rooflm bench spec --task continue` prompts with)")
    p.add_argument("--line-breaks", choices=["unwrap", "keep"], default="unwrap",
                   help="unwrap (default): join the hard-wrapped lines of each paragraph of --data / --eval-data with "
                        "spaces, as prose is given to a model (the shipped excerpts are wrapped at about 72 columns "
                        "for reading: continuations of wrapped text end lines the heads learn to predict, which "
                        "unwrapped prompts never show); keep: the files as they are")
    p.add_argument("--heads", type=_positive("--heads"), default=4, help="number of heads (k at most)")
    p.add_argument("--steps", type=_positive("--steps"), default=200, help="optimizer steps")
    p.add_argument("--lr", type=_positive("--lr", float), default=2e-3, help="AdamW learning rate (peak)")
    p.add_argument("--seq-len", type=_positive("--seq-len"), default=256,
                   help="tokens per window of text (training on the text; the held-out text report)")
    p.add_argument("--batch-size", type=_positive("--batch-size"), default=2,
                   help="sequences (windows or continuations) per step")
    p.add_argument("--max-train-tokens", type=_positive("--max-train-tokens"), default=16384,
                   help="distinct training tokens (the frozen model runs over each once; epochs reuse them)")
    p.add_argument("--eval-tokens", type=_positive("--eval-tokens"), default=1024, help="held-out tokens")
    p.add_argument("--log-every", type=_positive("--log-every"), default=20, help="steps between loss lines")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order")
    p.add_argument("--self-distill", type=_positive("--self-distill"), default=None, metavar="N",
                   help="self-distillation (Cai et al. 2024, section 2.3.2): train on N greedy continuations that the "
                        "model itself generates from prompts taken from the training text, instead of on the text "
                        "(greedy verification accepts a draft when it equals the model's own token)")
    p.add_argument("--distill-len", type=_positive("--distill-len"), default=256,
                   help="tokens per greedy continuation (fewer when the model ends one with EOS)")
    p.add_argument("--distill-prompt-len", type=_positive("--distill-prompt-len"), default=64,
                   help="tokens per prompt window of the training text (context only: not trained on)")
    p.add_argument("--distill-eval", type=_positive("--distill-eval"), default=8, metavar="N",
                   help="held-out greedy continuations (prompts from --eval-data) for the accuracy against the "
                        "model's greedy tokens and the predicted mean accepted length")
    p.add_argument("--distill-soft", action="store_true",
                   help="with --self-distill: train against the model's full next-token distributions (soft "
                        "labels) instead of its greedy tokens; greedy acceptance only needs the argmax, so hard "
                        "labels are the default")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the model's activations (auto: float32 on the CPU, bfloat16 on CUDA); the heads train in "
                        "float32 either way")
    p.add_argument("--max-cache-gb", type=_positive("--max-cache-gb", float), default=8.0,
                   help="most GB of kept hidden states (float32, hidden_size numbers per trained position, on the "
                        "device); a run that needs more is refused before any sequence runs")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the heads to")
    p.set_defaults(func=_train)


def unwrap_lines(text: str) -> str:
    """Each paragraph (blocks separated by blank lines) on one line, its lines joined with single spaces."""
    paragraphs = (" ".join(line.strip() for line in block.splitlines() if line.strip())
                  for block in re.split(r"\n[ \t]*\n", text))
    return "\n\n".join(p for p in paragraphs if p)


def _read(path: str | None, shipped: str) -> str:
    if path is None:
        from importlib import resources

        return (resources.files("rooflm") / "bench" / "data" / shipped).read_text()
    with open(path) as f:
        return f.read()


def _train(args: argparse.Namespace) -> int:
    from rooflm.engine.engine import resolve_device, resolve_dtype
    from rooflm.loader import load_model
    from rooflm.spec_decode.medusa import model_identity, save_medusa_heads
    from rooflm.spec_decode.medusa_train import MedusaTrainConfig, train_medusa
    from rooflm.tokenizer import load_tokenizer

    try:
        tc = MedusaTrainConfig(num_heads=args.heads, steps=args.steps, lr=args.lr, seq_len=args.seq_len,
                               batch_size=args.batch_size, max_train_tokens=args.max_train_tokens,
                               eval_tokens=args.eval_tokens, log_every=args.log_every, seed=args.seed,
                               self_distill=args.self_distill or 0, distill_len=args.distill_len,
                               distill_prompt_len=args.distill_prompt_len, distill_eval=args.distill_eval,
                               distill_soft=args.distill_soft, max_cache_gb=args.max_cache_gb)
    except ValueError as e:
        raise SystemExit(f"rooflm train-medusa: {e}") from None
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise SystemExit(f"rooflm train-medusa: --device {args.device!r}: {e}") from None
    dtype = resolve_dtype(args.dtype, device)
    train_text = _read(args.data, "austen_emma.txt")
    eval_text = _read(args.eval_data, "austen_pride_and_prejudice.txt")
    if args.line_breaks == "unwrap":
        train_text, eval_text = unwrap_lines(train_text), unwrap_lines(eval_text)
    model, cfg = load_model(args.model, load_format=args.load_format, dtype=dtype, device=device,
                            show_progress=False, quantization=args.quantization)
    for p in model.parameters():
        p.requires_grad_(False)
    tok = load_tokenizer(args.model)
    train_ids = list(tok(train_text)["input_ids"])
    eval_ids = list(tok(eval_text)["input_ids"])
    if tc.self_distill:
        print(f"training {tc.num_heads} heads on {tc.self_distill} greedy continuations of up to {tc.distill_len} "
              f"tokens ({tc.steps} steps of {tc.batch_size} sequences) on {device}, {dtype}", flush=True)
    else:
        print(f"training {tc.num_heads} heads on {min(len(train_ids), tc.max_train_tokens)} of {len(train_ids)} "
              f"tokens ({tc.steps} steps of {tc.batch_size} x {tc.seq_len}) on {device}, {dtype}; held out: "
              f"{min(len(eval_ids), tc.eval_tokens)} tokens", flush=True)
    try:
        heads, summary = train_medusa(model, cfg, train_ids, eval_ids, tc, log=lambda s: print(s, flush=True))
    except ValueError as e:  # too short a text, too large a hidden-state cache: bad input, not a crash
        raise SystemExit(f"rooflm train-medusa: {e}") from None
    save_medusa_heads(heads, args.out, model_identity(cfg, args.model or "SmolLM2-135M-Instruct"))
    print(f"wrote {args.out} ({summary['seconds']:.0f} s)")
    return 0
