"""The workloads of ``rooflm bench serve`` (their flags and the request lists) and the scheduling reports: the
priority workload's high-priority TTFT alone vs under load, and SLO-aware admission's attainment and rejections.

Priority (``--dataset-name priority``): before the loaded run, each high-priority request of the trace is sent alone
(one at a time, to the idle server); their TTFTs are the *idle* baseline. Then the whole trace runs; the report
gives each class's TTFT (mean, p50, p99) and the high-priority p99 under load over its idle p99 (``priority`` keeps
it near 1; under ``fcfs`` a high-priority request waits behind the queue).

SLO admission (``rooflm serve --ttft-slo-ms``): a request the server refuses because it cannot meet the SLO is a
503 with code ``ttft_slo_unattainable``; the report counts those as *rejected* (not failed) when ``--goodput
ttft:MS`` gives the SLO, and gives the attainment of the admitted (completed) requests, the fraction rejected and
the attainment over all requests. Whether a rejected request would really have missed cannot be observed in the run
that rejected it; ``--compare-with RUN.json`` reads a run of the same trace against a server without admission and
counts, for each request rejected here, whether it missed the SLO there (a pessimistic witness: that run also served
the requests admission turned away, so its queue was longer).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Sequence
from typing import Any, Protocol

from rooflm.bench import datasets
from rooflm.bench.clients import percentile

SLO_REJECTED_CODE = "ttft_slo_unattainable"  # the server's error code for a request refused by admission
DATASETS = ("sharegpt-like", "fixed", "heavy-tailed", "multi-client", "priority")


class TTFTResult(Protocol):
    success: bool
    ttft: float  # seconds
    error: str


def add_workload_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--dataset-path", default=None, help="a text file to draw prompts from (default: the shipped "
                                                        "Pride and Prejudice excerpt)")
    g.add_argument("--dataset-name", default=None, choices=DATASETS,
                   help="the workload (default: fixed when --input-len/--output-len is given, else sharegpt-like)")
    g.add_argument("--pareto-alpha", type=float, default=datasets.HEAVY_TAIL_ALPHA,
                   help="heavy-tailed: the Pareto tail index of output lengths (default 1.1)")
    g.add_argument("--num-light-clients", type=int, default=3, help="multi-client: light clients (default 3)")
    g.add_argument("--heavy-fraction", type=float, default=0.6,
                   help="multi-client: the heavy client's share of the requests (default 0.6)")
    g.add_argument("--num-high-priority", type=int, default=4,
                   help="priority: high-priority requests among --num-prompts (default 4)")
    g.add_argument("--no-idle-baseline", action="store_true",
                   help="priority: skip sending the high-priority requests alone before the run")
    g.add_argument("--input-len", type=int, default=None,
                   help="fixed prompt length in tokens (fixed dataset; default: none)")
    g.add_argument("--output-len", type=int, default=None,
                   help="fixed output length in tokens (fixed dataset; default: none)")
    g.add_argument("--mean-input-len", type=float, default=datasets.SHAREGPT_MEAN_INPUT,
                   help="sharegpt-like: mean prompt tokens after clipping (default 200)")
    g.add_argument("--mean-output-len", type=float, default=datasets.SHAREGPT_MEAN_OUTPUT,
                   help="sharegpt-like: mean output tokens after clipping (default 180)")
    g.add_argument("--max-input-len", type=int, default=datasets.MAX_LEN, help="sharegpt-like: clip (default 1024)")
    g.add_argument("--max-output-len", type=int, default=datasets.MAX_LEN, help="sharegpt-like: clip (default 1024)")
    g.add_argument("--tokens-per-word", type=float, default=None,
                   help="prompt sizing ratio (default: measured with the server's /tokenize, else 1.3)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos=true (a rooflm/vLLM extra) so outputs have exactly the asked length")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body (default: none)")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrival times")


def build_requests(args: argparse.Namespace, windows: datasets.TextWindows) -> tuple[str, list[datasets.SampleRequest]]:
    """(the workload's name, its requests in arrival order) from the flags."""
    name = args.dataset_name
    if name == "heavy-tailed":
        return name, datasets.heavy_tailed(args.num_prompts, windows, seed=args.seed,
                                           mean_input_len=args.mean_input_len, max_input_len=args.max_input_len,
                                           alpha=args.pareto_alpha, max_output_len=args.max_output_len)
    if name == "multi-client":
        return name, datasets.multi_client(args.num_prompts, windows, seed=args.seed,
                                           num_light=args.num_light_clients, heavy_fraction=args.heavy_fraction,
                                           input_len=args.input_len or 64, output_len=args.output_len or 64)
    if name == "priority":
        return name, datasets.priority_mix(args.num_prompts, windows, seed=args.seed,
                                           num_high=args.num_high_priority, input_len=args.input_len or 64,
                                           output_len=args.output_len or 32)
    if name == "fixed" or args.input_len is not None or args.output_len is not None:
        return "fixed", datasets.fixed_lengths(args.num_prompts, windows,
                                               args.input_len or datasets.SHAREGPT_MEAN_INPUT,
                                               args.output_len or datasets.SHAREGPT_MEAN_OUTPUT, seed=args.seed)
    return "sharegpt-like", datasets.sharegpt_like(args.num_prompts, windows, seed=args.seed,
                                                   mean_input_len=args.mean_input_len,
                                                   mean_output_len=args.mean_output_len,
                                                   max_input_len=args.max_input_len,
                                                   max_output_len=args.max_output_len)


def idle_requests(requests: Sequence[datasets.SampleRequest], windows: datasets.TextWindows,
                  seed: int) -> list[datasets.SampleRequest]:
    """The idle baseline of the priority workload: one request per high-priority one, of the same lengths and
    priority but another prompt (the same prompt would be a prefix-cache hit in the loaded run)."""
    rng = random.Random(f"idle-{seed}")
    return [datasets.SampleRequest(windows.prompt(rng, r.prompt_len), r.prompt_len, r.output_len, priority=r.priority)
            for r in requests if r.priority == datasets.HIGH_PRIORITY]


def ttft_stats(results: Sequence[TTFTResult]) -> dict[str, Any]:
    """count, completed and the TTFT mean / p50 / p99 (ms) of the completed ones."""
    xs = [r.ttft * 1000 for r in results if r.success]
    return {"count": len(results), "completed": len(xs),
            "mean_ttft_ms": statistics.fmean(xs) if xs else None,
            "p50_ttft_ms": percentile(xs, 50) if xs else None,
            "p99_ttft_ms": percentile(xs, 99) if xs else None}


def priority_report(results: Sequence[TTFTResult], requests: Sequence[datasets.SampleRequest],
                    idle: Sequence[TTFTResult] | None) -> dict[str, Any]:
    """Per class TTFT under load, the high-priority requests' TTFT alone, and their p99 ratio (load / idle)."""
    high = [r for r, q in zip(results, requests) if q.priority == datasets.HIGH_PRIORITY]
    low = [r for r, q in zip(results, requests) if q.priority != datasets.HIGH_PRIORITY]
    out: dict[str, Any] = {"high": ttft_stats(high), "low": ttft_stats(low)}
    if idle is not None:
        out["high_idle"] = ttft_stats(idle)
        loaded, alone = out["high"]["p99_ttft_ms"], out["high_idle"]["p99_ttft_ms"]
        out["high_p99_ttft_load_over_idle"] = loaded / alone if loaded is not None and alone else None
    return out


def is_slo_rejection(r: TTFTResult) -> bool:
    return not r.success and SLO_REJECTED_CODE in r.error


def slo_report(results: Sequence[TTFTResult], slo_ms: float) -> dict[str, Any]:
    """Rejected (503 ``ttft_slo_unattainable``), admitted (completed) and the TTFT SLO attainment of each."""
    rejected = [i for i, r in enumerate(results) if is_slo_rejection(r)]
    admitted = [r for r in results if r.success]
    met = sum(1 for r in admitted if r.ttft * 1000 <= slo_ms)
    n = len(results)
    return {"ttft_slo_ms": slo_ms, "requests": n, "admitted": len(admitted), "rejected": len(rejected),
            "failed_other": n - len(admitted) - len(rejected), "met": met,
            "attainment_admitted": met / len(admitted) if admitted else None,
            "attainment_all": met / n if n else None, "rejected_fraction": len(rejected) / n if n else None,
            "rejected_indices": rejected}


def counterfactual(report: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """For the requests ``report`` rejected: how many missed the SLO (or failed) in ``baseline``, a run of the same
    trace without admission (its JSON result: ``ttfts`` in seconds and ``errors`` per request)."""
    ttfts, errors = baseline.get("ttfts"), baseline.get("errors")
    if not isinstance(ttfts, list) or not isinstance(errors, list) or len(ttfts) != report["requests"] \
            or len(errors) != len(ttfts):
        raise ValueError(f"--compare-with: the run has {len(ttfts) if isinstance(ttfts, list) else 'no'} per-request "
                         f"TTFTs, this one {report['requests']}: expected a run of the same trace")
    slo_s = report["ttft_slo_ms"] / 1000
    missed = [i for i in report["rejected_indices"] if errors[i] or ttfts[i] > slo_s]
    n = len(report["rejected_indices"])
    baseline_met = sum(1 for t, e in zip(ttfts, errors) if not e and t <= slo_s)
    return {"rejected_would_miss": len(missed), "rejected_would_meet": n - len(missed),
            "rejected_would_miss_fraction": len(missed) / n if n else None,
            "baseline_attainment_all": baseline_met / len(ttfts) if ttfts else None}


def scheduling_metrics(args: argparse.Namespace, results: Sequence[TTFTResult],
                       requests: Sequence[datasets.SampleRequest], idle: Sequence[TTFTResult] | None,
                       goodput: dict[str, float]) -> dict[str, Any]:
    """The report's ``priority`` and ``slo`` sections, when the run asks for them."""
    out: dict[str, Any] = {}
    if args.dataset_name == "priority":
        out["priority"] = priority_report(results, requests, idle)
    if "ttft" in goodput:
        slo = slo_report(results, goodput["ttft"])
        if getattr(args, "compare_with", None):
            with open(args.compare_with, encoding="utf-8") as f:
                slo.update(counterfactual(slo, json.load(f)))
        out["slo"] = slo
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_scheduling(m: dict[str, Any]) -> str:
    lines = []
    if "priority" in m:
        p = m["priority"]
        lines.append("TTFT by priority class (ms): count, completed, mean, p50, p99")
        for name in ("high_idle", "high", "low"):
            if name in p:
                s = p[name]
                label = {"high_idle": "high, alone", "high": "high, under load", "low": "low, under load"}[name]
                lines.append(f"  {label:<18} {s['count']:>4} {s['completed']:>4} {_ms(s['mean_ttft_ms']):>8} "
                             f"{_ms(s['p50_ttft_ms']):>8} {_ms(s['p99_ttft_ms']):>8}")
        if p.get("high_p99_ttft_load_over_idle") is not None:
            lines.append(f"  high-priority p99 TTFT under load / alone: {p['high_p99_ttft_load_over_idle']:.2f}x")
    if "slo" in m:
        s = m["slo"]
        lines.append(f"TTFT SLO {s['ttft_slo_ms']:g} ms: {s['requests']} requests, {s['admitted']} admitted, "
                     f"{s['rejected']} rejected ({_frac(s['rejected_fraction'])}), {s['failed_other']} failed "
                     "otherwise")
        lines.append(f"  attainment: {_frac(s['attainment_admitted'])} of the admitted, {_frac(s['attainment_all'])} "
                     "of all requests")
        if "rejected_would_miss" in s:
            lines.append(f"  rejected requests that missed the SLO in the run without admission: "
                         f"{s['rejected_would_miss']} of {s['rejected']} (that run's attainment: "
                         f"{_frac(s['baseline_attainment_all'])} of all)")
    return "\n".join(lines)
