"""Speculative decoding against plain decoding, same model, prompts and machine, in one process.

``rooflm bench spec --task repeat --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'``

Tasks (prompts built from the public-domain text shipped with rooflm):
- ``repeat``: an input-grounded task: the prompt gives a passage, then asks for it again and starts the copy (prompt
  lookup's best case, like editing, quoting or correcting a given text);
- ``continue``: free continuation of a held-out passage (the draft can only find repetitions of the text itself).
Each mode runs the same prompts, ``--batch-size`` at a time, greedy with EOS ignored, after one warm-up request;
one mode after another, or (``--interleave``) all loaded at once, taking turns batch by batch.
Reported: output tokens/s of both modes and their ratio, whether the greedy tokens are identical (they must be),
the acceptance rate and mean accepted length, and the speed-up the roofline predicts for that acceptance rate (a
verify step of k + 1 tokens per request, plus a draft model's k steps, against a plain decode step, both at the
prompts' mean context). Any ``method`` works: ``ngram``, ``draft_model``, ``self`` and ``medusa`` (chain or tree).
"""
from __future__ import annotations

import argparse
import json
import time
from importlib import resources

from rooflm.units import tok_rate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--load-format", default="auto", help="auto, dummy (random weights), safetensors, gguf")
    p.add_argument("--dtype", default="auto", help="auto (float32 on the CPU, bfloat16 on CUDA), float16, "
                   "bfloat16, float32")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    p.add_argument("--quantization", default=None,
                   help="none | w8a16 | w4a16 | gguf | ... (default: what the checkpoint holds)")
    p.add_argument("--task", choices=["repeat", "continue"], default="repeat",
                   help="repeat: prompts that ask to copy a text (drafts match often); continue: free continuation")
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                   help="JSON, as the engine's speculative_config; a JSON list of them runs each against one plain "
                        "run")
    p.add_argument("--batch-size", type=int, default=1, help="requests run together")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts in all")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per prompt")
    p.add_argument("--interleave", action="store_true",
                   help="load every mode at once and let them take turns batch by batch (the same machine state for "
                        "each; on a shared CPU whose speed drifts); default: one mode after another")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--verify-cost", action="store_true",
                   help="instead: time verify steps of k+1 tokens against a decode step (see --verify-batch-sizes)")
    p.add_argument("--verify-batch-sizes", default="1,64", help="with --verify-cost (comma list)")
    p.add_argument("--verify-context", type=int, default=1024, help="with --verify-cost: context tokens")


def build_prompts(task: str, n: int, tokenizer) -> list[list[int]]:
    text = (resources.files("rooflm") / "bench" / "data" / "austen_pride_and_prejudice.txt").read_text()
    paragraphs = [p.strip().replace("\n", " ") for p in text.split("\n\n") if len(p.strip()) > 400]
    prompts = []
    for i in range(n):
        passage = paragraphs[(7 * i) % len(paragraphs)][:900]
        if task == "repeat":
            # The passage, a heading asking for it again, and its first words: the continuation is a copy.
            text = f"{passage}\n\nThe same passage, repeated word for word:\n\n{passage[:40]}"
            prompts.append(list(tokenizer(text)["input_ids"]))
        else:
            prompts.append(list(tokenizer(passage)["input_ids"]))
    return prompts


class _Mode:
    """One engine (plain, or one speculative configuration) and what it measured so far: its prompts are given batch
    by batch (``run``), so several modes can take turns on the same prompts."""

    def __init__(self, args: argparse.Namespace, spec: str | None, warmup: list[int]) -> None:
        from rooflm.llm import LLM
        from rooflm.sampling_params import SamplingParams

        self.spec = spec
        self.llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                       speculative_config=spec, show_progress=False, quantization=getattr(args, "quantization", None))
        self.params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        self.llm.generate([warmup], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        s = self.llm.engine.get_stats()
        self.base = (s.spec_draft_tokens, s.spec_accepted_tokens, s.spec_verifications, s.num_steps)
        self.elapsed = 0.0
        self.outs: list = []

    def run(self, batch: list[list[int]]) -> None:
        t0 = time.perf_counter()
        self.outs += self.llm.generate(batch, self.params, use_tqdm=False)
        self.elapsed += time.perf_counter() - t0

    def result(self, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
        llm, spec, elapsed = self.llm, self.spec, self.elapsed
        s = llm.engine.get_stats()
        base = self.base
        drafts, accepted, verifications = (s.spec_draft_tokens - base[0], s.spec_accepted_tokens - base[1],
                                           s.spec_verifications - base[2])
        generated = sum(len(o.outputs[0].token_ids) for o in self.outs)
        res = {"elapsed_s": elapsed, "output_tok_s": generated / elapsed, "steps": s.num_steps - base[3],
               "tokens": [o.outputs[0].token_ids for o in self.outs], "draft_tokens": drafts,
               "accepted_tokens": accepted, "acceptance_rate": accepted / drafts if drafts else None,
               "mean_accepted_length": 1 + accepted / verifications if verifications else None,
               "spec_steps_disabled": s.spec_steps_disabled}
        if spec is not None and res["acceptance_rate"] is not None:
            from rooflm.spec_decode.proposer import expected_tokens

            k = llm.engine.spec_config.num_speculative_tokens
            n = llm.engine.proposer.config.num_speculative_tokens  # tokens verified per request: a Medusa tree's nodes
            ctx = int(sum(len(p) for p in prompts) / len(prompts) + args.output_len / 2)
            b = args.batch_size
            plain = llm.engine.roofline.predict([1] * b, [ctx] * b, b)
            verify = llm.engine.roofline.predict([n + 1] * b, [ctx + n] * b, b * (n + 1))
            # a draft model's k single-token steps: each about its share of the target's weight bytes of a decode step
            draft = llm.engine.proposer.draft_cost * k * plain
            res["roofline_verify_over_decode"] = verify / plain
            res["draft_over_decode"] = draft / plain
            # a chain's tokens per verification follow from the acceptance rate; a tree's are measured
            per_verify = (res["mean_accepted_length"] if n != k else expected_tokens(k, res["acceptance_rate"]))
            res["predicted_speedup"] = per_verify * plain / (verify + draft)
        return res


def _run_modes(args: argparse.Namespace, prompts: list[list[int]], specs: list[str | None]) -> list[dict]:
    """Each mode over every prompt, ``--batch-size`` at a time: one mode after another, or with ``--interleave``
    every mode loaded at once and taking turns batch by batch (a machine whose speed drifts during the run, such as
    a shared CPU, then slows every mode alike)."""
    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    if not args.interleave:
        results = []
        for spec in specs:
            mode = _Mode(args, spec, prompts[0])
            for batch in batches:
                mode.run(batch)
            results.append(mode.result(args, prompts))
            del mode
        return results
    modes = [_Mode(args, spec, prompts[0]) for spec in specs]
    for batch in batches:
        for mode in modes:
            mode.run(batch)
    return [m.result(args, prompts) for m in modes]


def run(args: argparse.Namespace) -> int:
    from rooflm.tokenizer import load_tokenizer

    if min(args.batch_size, args.num_prompts, args.output_len) < 1:
        raise ValueError("--batch-size, --num-prompts and --output-len must be >= 1")
    if args.verify_cost:
        try:
            batches = [int(x) for x in args.verify_batch_sizes.split(",")]
        except ValueError:
            raise ValueError(f"--verify-batch-sizes={args.verify_batch_sizes!r}: expected a comma list of integers")
        print(f"rooflm bench spec --verify-cost: {args.model or 'default model'}, context {args.verify_context}")
        rows = verify_cost(args.model, args.load_format, args.dtype, batches, args.verify_context, list(range(1, 9)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    configs = spec_configs(args.speculative_config)
    tokenizer = load_tokenizer(args.model)
    prompts = build_prompts(args.task, args.num_prompts, tokenizer)
    plain, *specs = _run_modes(args, prompts, [None] + configs)
    runs = []
    print(f"rooflm bench spec: task={args.task} batch={args.batch_size} prompts={len(prompts)} "
          f"output={args.output_len}{' interleaved' if args.interleave else ''}")
    print(f"  plain        {tok_rate(plain['output_tok_s']):>14}  ({plain['steps']} steps)")
    for config, spec in zip(configs, specs):  # each against the same plain run
        run_res = {"speculative_config": json.loads(config),
                   "speculative": {k: v for k, v in spec.items() if k != "tokens"},
                   "speedup": spec["output_tok_s"] / plain["output_tok_s"],
                   "identical_tokens": plain["tokens"] == spec["tokens"]}
        runs.append(run_res)
        print(f"  speculative  {tok_rate(spec['output_tok_s']):>14}  ({spec['steps']} steps)   speed-up "
              f"{run_res['speedup']:.2f}x   greedy tokens identical: {run_res['identical_tokens']}   {config}")
        if spec["acceptance_rate"] is not None:
            print(f"    acceptance {spec['acceptance_rate']:.1%}, mean accepted length "
                  f"{spec['mean_accepted_length']:.2f}; roofline: a verify step costs "
                  f"{spec['roofline_verify_over_decode']:.2f}x a decode step, drafting {spec['draft_over_decode']:.2f}x, "
                  f"predicted speed-up {spec['predicted_speedup']:.2f}x")
    res = {"task": args.task, "batch_size": args.batch_size, "num_prompts": len(prompts), "interleave": args.interleave,
           "output_len": args.output_len, "plain": {k: v for k, v in plain.items() if k != "tokens"}, **runs[0]}
    if len(runs) > 1:
        res["runs"] = runs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all(r["identical_tokens"] for r in runs) else 1


def spec_configs(text: str) -> list[str]:
    """``--speculative-config``: one JSON object, or a JSON list of them (each measured against one plain run)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config={text!r} is not valid JSON: {e.msg}") from None
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(x, dict) for x in items):
        raise ValueError(f"--speculative-config={text!r} is invalid: expected a JSON object or a non-empty list of "
                         "them")
    return [json.dumps(x) for x in items]


def verify_cost(model_name: str, load_format: str, dtype: str, batch_sizes: list[int], context: int,
                ks: list[int]) -> list[dict]:
    """The cost of a verify step of k + 1 tokens per request over a plain decode step (k = 0), at ``context`` tokens
    of context, each timed as one forward pass plus the LM head on every scored position, beside the live roofline's
    prediction for the same steps. On a GPU each step is timed twice with CUDA events: launched eagerly, and replayed
    from a CUDA graph of its shape (as the engine runs decode and chain verify steps)."""
    import torch

    from rooflm.attention.metadata_utils import build_attention_metadata
    from rooflm.llm import LLM
    from rooflm.worker.cuda_graphs import DecodeGraphRunner

    llm = LLM(model_name, load_format=load_format, dtype=dtype, enforce_eager=True, show_progress=False,
              max_model_len=context + max(ks) + 1, kv_cache_memory=None if torch.cuda.is_available() else 2**30)
    engine = llm.engine
    model, runner, bs = engine.model, engine.runner, engine.config.block_size
    cuda = engine.device.type == "cuda"
    rows = []
    for b in batch_sizes:
        blocks_per_seq = -(-(context + max(ks) + 1) // bs)
        if b * blocks_per_seq > runner.num_blocks:
            continue
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]
        graphs = None
        if cuda:
            graphs = DecodeGraphRunner(model, runner.kv_caches, b, blocks_per_seq, engine.device, max(ks) + 1)
            graphs.capture([b], {k + 1: [b] for k in ks})
        times, graph_times = {}, {}
        for k in [0] + ks:
            meta, pos = build_attention_metadata(tables, [context] * b, [k + 1] * b, bs, engine.device)
            ids = torch.randint(0, engine.model_config.vocab_size, (b * (k + 1),), device=engine.device)

            def step():
                with torch.inference_mode():
                    return model.compute_logits(model(ids, pos, runner.kv_caches, meta))

            times[k] = _median_time(step, cuda)
            if graphs is not None:
                graph_times[k] = _median_time(lambda: graphs.run(ids, pos, meta), cuda)
        for k in ks:
            predicted = (engine.roofline.predict([k + 1] * b, [context + k + 1] * b, b * (k + 1))
                         / engine.roofline.predict([1] * b, [context + 1] * b, b))
            row = {"batch": b, "k": k, "decode_s": times[0], "verify_s": times[k],
                   "measured_ratio": times[k] / times[0], "roofline_ratio": predicted}
            line = (f"  batch {b:3d}  k={k}: eager verify {times[k] * 1e3:8.3f} ms / decode {times[0] * 1e3:8.3f} ms"
                    f" = {times[k] / times[0]:.3f}")
            if graph_times:
                row.update(graph_decode_s=graph_times[0], graph_verify_s=graph_times[k],
                           graph_ratio=graph_times[k] / graph_times[0])
                line += (f"; graphs {graph_times[k] * 1e3:8.3f} / {graph_times[0] * 1e3:8.3f} ms = "
                         f"{graph_times[k] / graph_times[0]:.3f}")
            rows.append(row)
            print(f"{line}  (roofline {predicted:.3f})")
        graphs = None  # its memory pool goes with it
    return rows


def _median_time(step, cuda: bool, reps: int = 5) -> float:
    """Median seconds of ``step`` after two warm-up calls (CUDA events on a GPU, the wall clock elsewhere)."""
    import torch

    for _ in range(2):
        step()
    samples = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2]


def latency_comparison(engine, spec: str, prompts: list[list[list[int]]], plain_iters: list[dict], output_len: int,
                       one_iteration, plain: dict) -> dict:
    """``rooflm bench latency --speculative-config``: the timed iterations again (the same prompts) on a second engine
    over the same loaded model with ``spec``; medians, the speed-up over the plain run, acceptance and mean accepted
    length, and whether the greedy tokens are identical."""
    import dataclasses
    import statistics

    from rooflm.engine.engine import LLMEngine

    c = engine.config
    # a draft model's pool takes blocks of its own beside the target's: room for the same tokens
    kv = c.kv_cache_memory if c.kv_cache_memory is None or "draft_model" not in spec else 2 * c.kv_cache_memory
    # the plain run's scheduling mode too: steps in which speculation is switched off overlap as the plain ones do
    config = dataclasses.replace(c, speculative_config=spec, kv_cache_memory=kv)
    spec_engine = LLMEngine(config, model=engine.model, model_config=engine.model_config, tokenizer=engine.tokenizer)
    one_iteration(spec_engine, prompts[0], min(output_len, 16))  # warm-up
    before = spec_engine.get_stats()
    base = (before.spec_draft_tokens, before.spec_accepted_tokens, before.spec_verifications)
    iters = [one_iteration(spec_engine, p, output_len) for p in prompts]
    s = spec_engine.get_stats()
    drafts, accepted, verifications = (s.spec_draft_tokens - base[0], s.spec_accepted_tokens - base[1],
                                       s.spec_verifications - base[2])
    tpot = statistics.median(it["tpot_s"] for it in iters)
    e2e = statistics.median(it["e2e_s"] for it in iters)
    batch = len(prompts[0])
    return {"speculative_config": json.loads(spec) if isinstance(spec, str) else spec,
            "tpot_s": tpot, "decode_tok_s": batch / tpot, "e2e_tok_s": batch * output_len / e2e,
            "speedup_decode": plain["tpot_s"] / tpot, "speedup_e2e": plain["e2e_s"] / e2e,
            "draft_tokens": drafts, "acceptance_rate": accepted / drafts if drafts else None,
            "mean_accepted_length": 1 + accepted / verifications if verifications else None,
            "spec_steps_disabled": s.spec_steps_disabled,
            "identical_tokens": [it["tokens"] for it in iters] == [it["tokens"] for it in plain_iters]}


def latency_line(r: dict) -> str:
    acc = (f"acceptance {r['acceptance_rate']:.1%}, mean accepted length {r['mean_accepted_length']:.2f}"
           if r["acceptance_rate"] is not None else "no drafts verified")
    return (f"  speculative {r['speculative_config']}: decode {r['decode_tok_s']:.1f} tok/s "
            f"({r['speedup_decode']:.2f}x plain), end-to-end {r['e2e_tok_s']:.1f} tok/s ({r['speedup_e2e']:.2f}x); "
            f"{acc}; {r['spec_steps_disabled']} steps without drafts (roofline switch-off); greedy tokens "
            f"identical: {r['identical_tokens']}")
