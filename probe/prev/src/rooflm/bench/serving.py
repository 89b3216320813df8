"""``rooflm bench serve``: load-test any OpenAI-compatible server over plain HTTP.

Requests are streaming completions (or chat completions) sent with Poisson arrivals at ``--request-rate`` requests/s
(``inf``: all at once), optionally capped at ``--max-concurrency`` in flight. For each request we measure, on the
client's clock:

- TTFT: send → first chunk carrying text;
- ITL: the gaps between consecutive chunks carrying text;
- TPOT: (E2EL − TTFT) / (output tokens − 1), requests with more than one output token;
- E2EL: send → last byte.

Token counts come from the server's ``usage`` (``stream_options.include_usage``); a server that sends none is
counted with the dataset's target prompt length and one token per text chunk. Metric names and the JSON keys are
vLLM's (``benchmark_serving.py``) so results compare: completed, total_input_tokens, total_output_tokens,
request_throughput, request_goodput, output_throughput, total_token_throughput, {mean,median,std,p99}_{ttft,tpot,
itl,e2el}_ms. Goodput counts the requests meeting every SLO given with ``--goodput ttft:MS tpot:MS e2el:MS``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rooflm.bench import datasets, workloads
from rooflm.bench.clients import percentile
from rooflm.bench.clients import format_clients, jct_stats, per_client_metrics
from rooflm.bench.output import add_output_args, check_output_args, describe_error, report_stream, write_outputs

METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                  "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds, send → last byte
    error: str = ""
    usage_reported: bool = False
    user: str | None = None  # the client (multi-client workload)
    start: float = 0.0  # seconds from the start of the run to the send


# ---------------------------------------------------------------------------------------------------------------------
# One request
# ---------------------------------------------------------------------------------------------------------------------
def _chunk_text(data: dict[str, Any], chat: bool) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client: Any, url: str, headers: dict[str, str], model: str, req: datasets.SampleRequest,
                       chat: bool, ignore_eos: bool, extra_body: dict[str, Any]) -> RequestResult:
    payload: dict[str, Any] = {"model": model, "temperature": 0.0, "stream": True,
                               "stream_options": {"include_usage": True}}
    if chat:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    if req.user is not None:
        payload["user"] = req.user
    if req.priority is not None:
        payload["priority"] = req.priority
    payload.update(extra_body)

    result = RequestResult(prompt_len=req.prompt_len, user=req.user)
    chunks_with_text = 0
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data_str = line[len("data:"):].strip()
                if data_str == "[DONE]":
                    break
                data = json.loads(data_str)
                if "error" in data:
                    result.error = f"stream error: {json.dumps(data['error'])[:300]}"
                    return result
                now = time.perf_counter()
                if _chunk_text(data, chat):
                    if chunks_with_text == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks_with_text += 1
                    last = now
                usage = data.get("usage")
                if usage:
                    result.usage_reported = True
                    result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
                    result.output_len = int(usage.get("completion_tokens") or 0)
        result.latency = time.perf_counter() - start
        if not result.usage_reported:
            result.output_len = chunks_with_text
        if chunks_with_text == 0:
            result.error = "the response carried no text"
            return result
        result.success = True
    except Exception as e:  # network errors, timeouts, bad JSON: a failed request, not a failed benchmark
        result.error = describe_error(e)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------------
def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] → {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {item!r} is invalid: expected NAME:MS with NAME one of ttft, tpot, e2el")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r} is invalid: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r} is invalid: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def _tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else None


def compute_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                    goodput: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    samples_ms = {
        "ttft": [r.ttft * 1000 for r in ok],
        "tpot": [t * 1000 for r in ok if (t := _tpot(r)) is not None],
        "itl": [x * 1000 for r in ok for x in r.itl],
        "e2el": [r.latency * 1000 for r in ok],
    }
    good = 0
    for r in ok:
        tpot = _tpot(r)
        if ("ttft" in goodput and r.ttft * 1000 > goodput["ttft"]) or \
                ("e2el" in goodput and r.latency * 1000 > goodput["e2el"]) or \
                ("tpot" in goodput and tpot is not None and tpot * 1000 > goodput["tpot"]):
            continue
        good += 1
    duration = max(duration, 1e-9)
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for name in METRICS:
        xs = samples_ms[name]
        m[f"mean_{name}_ms"] = statistics.fmean(xs) if xs else 0.0
        m[f"median_{name}_ms"] = statistics.median(xs) if xs else 0.0
        m[f"std_{name}_ms"] = statistics.pstdev(xs) if xs else 0.0
        for p in percentiles:
            m[f"p{p:g}_{name}_ms"] = percentile(xs, p)
    return m


def format_report(m: dict[str, Any], percentiles: list[float], goodput: dict[str, float],
                  request_rate: float, max_concurrency: int | None) -> str:
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(label: str, value: Any, fmt: str = "<10.2f") -> None:
        lines.append(f"{label:<40} {value:{fmt}}" if not isinstance(value, str) else f"{label:<40} {value:<10}")

    row("Successful requests:", m["completed"], "<10")
    row("Failed requests:", m["failed"], "<10")
    row("Request rate configured (RPS):", "inf" if math.isinf(request_rate) else f"{request_rate:.2f}")
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency, "<10")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "<10")
    row("Total generated tokens:", m["total_output_tokens"], "<10")
    row("Request throughput (req/s):", m["request_throughput"])
    if goodput:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for name in METRICS:
        lines.append("{s:{c}^{n}}".format(s=_METRIC_TITLES[name], n=w, c="-"))
        up = name.upper()
        row(f"Mean {up} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {up} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {up} (ms):", m[f"p{p:g}_{name}_ms"])
    if goodput:
        lines.append("{s:{c}^{n}}".format(s="SLOs (goodput)", n=w, c="-"))
        for k, v in goodput.items():
            row(f"{k.upper()} SLO (ms):", v)
    lines.append("=" * w)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------------
def _httpx() -> Any:
    try:
        import httpx
    except ModuleNotFoundError:
        raise SystemExit("rooflm bench serve needs httpx: pip install httpx") from None
    return httpx


def _intervals(rng: random.Random, rate: float, burstiness: float):
    """Gaps between arrivals: Poisson (exponential gaps) at burstiness 1; gamma-distributed gaps with the same mean
    otherwise (< 1 burstier, > 1 more regular)."""
    while True:
        if math.isinf(rate):
            yield 0.0
        else:
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def _discover(client: Any, base_url: str, headers: dict[str, str], model: str | None) -> str:
    """The model to ask for: the one given, else the first one the server lists."""
    if model is None:
        r = await client.get(f"{base_url}/v1/models", headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"GET {base_url}/v1/models answered {r.status_code}: {r.text[:300]}; pass --model")
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"GET {base_url}/v1/models lists no model; pass --model")
        model = str(data[0]["id"])
    return model


async def _tokens_per_word(client: Any, base_url: str, headers: dict[str, str], model: str, text: str) -> float | None:
    sample = " ".join(text.split()[:2000])
    try:
        r = await client.post(f"{base_url}/tokenize", json={"model": model, "prompt": sample,
                                                            "add_special_tokens": False}, headers=headers)
        if r.status_code == 200:
            count = r.json().get("count") or len(r.json().get("tokens") or [])
            if count:
                return count / len(sample.split())
    except Exception:
        pass
    return None


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    httpx = _httpx()
    base_url = args.base_url.rstrip("/")
    for suffix in ("/v1/completions", "/v1/chat/completions", "/v1"):
        if base_url.endswith(suffix):
            base_url = base_url[: -len(suffix)]
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    url = base_url + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    goodput = parse_goodput(args.goodput)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    extra_body = json.loads(args.extra_body) if args.extra_body else {}

    limit = args.max_concurrency or args.num_prompts
    timeout = httpx.Timeout(args.request_timeout, connect=min(30.0, args.request_timeout))
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = await _discover(client, base_url, headers, args.model)
        text = datasets.load_text(args.dataset_path)
        tpw = args.tokens_per_word or await _tokens_per_word(client, base_url, headers, model, text) \
            or datasets.DEFAULT_TOKENS_PER_WORD
        windows = datasets.TextWindows(text, tpw)
        dataset_name, requests = workloads.build_requests(args, windows)

        if not args.no_warmup:  # one short request: checks the endpoint and model before the clock starts
            probe = datasets.SampleRequest(requests[0].prompt, requests[0].prompt_len, min(4, requests[0].output_len))
            first = await send_request(client, url, headers, model, probe, chat, args.ignore_eos, extra_body)
            if not first.success:
                raise RuntimeError(f"the initial test request to {url} failed: {first.error}")

        idle = None  # the priority workload's high-priority requests, each sent alone to the idle server
        if dataset_name == "priority" and not args.no_idle_baseline:
            idle = [await send_request(client, url, headers, model, r, chat, args.ignore_eos, extra_body)
                    for r in workloads.idle_requests(requests, windows, args.seed)]
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(req: datasets.SampleRequest) -> RequestResult:
            if semaphore is None:
                sent = time.perf_counter() - start
                r = await send_request(client, url, headers, model, req, chat, args.ignore_eos, extra_body)
            else:
                async with semaphore:
                    sent = time.perf_counter() - start
                    r = await send_request(client, url, headers, model, req, chat, args.ignore_eos, extra_body)
            r.start = sent
            return r

        print(f"rooflm bench serve: {len(requests)} requests ({dataset_name}) to {url}, model {model}, "
              f"rate {args.request_rate} req/s, max concurrency {args.max_concurrency or 'unlimited'}",
              file=sys.stderr, flush=True)
        gaps = _intervals(random.Random(args.seed + 1), args.request_rate, args.burstiness)
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            gap = next(gaps)
            if gap > 0:
                await asyncio.sleep(gap)
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    metrics = compute_metrics(results, duration, percentiles, goodput)
    metrics.update(jct_stats([r.latency for r in results if r.success]))
    metrics.update(workloads.scheduling_metrics(args, results, requests, idle, goodput))
    by_client = per_client_metrics(results)
    if by_client:
        metrics["per_client"] = by_client
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if chat else "openai",
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "dataset_name": dataset_name,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "tokens_per_word": tpw,
        "goodput_slos_ms": goodput or None,
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions (default) or /v1/chat/completions")
    parser.add_argument("--model", default=None, help="model id to ask for (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="mean arrivals per second, Poisson; inf (default) sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular (default 1)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at most (default: no limit)")
    workloads.add_workload_arguments(parser.add_argument_group("workload"))
    r = parser.add_argument_group("report")
    r.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 e2el:5000 (default: no goodput)")
    r.add_argument("--compare-with", default=None, metavar="RUN.json",
                   help="with --goodput ttft:MS: a JSON result of the same trace against a server without "
                        "--ttft-slo-ms; reports how many requests rejected here missed the SLO there (default: none)")
    r.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default 99)")
    add_output_args(r)
    r.add_argument("--result-file", default=None, metavar="PATH",
                   help="vLLM's name of --json PATH, used when --json is not given (default: none)")
    r.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    r.add_argument("--no-warmup", action="store_true", help="skip the initial single test request")


def _validate(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts={args.num_prompts} is invalid: expected >= 1")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate={args.request_rate} is invalid: expected > 0 (or inf)")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness={args.burstiness} is invalid: expected > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} is invalid: expected >= 1")
    if args.request_timeout <= 0:
        raise ValueError(f"--request-timeout={args.request_timeout} is invalid: expected > 0")
    for name in ("input_len", "output_len"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')}={v} is invalid: expected >= 1")
    if args.extra_body:
        try:
            if not isinstance(json.loads(args.extra_body), dict):
                raise ValueError
        except ValueError:
            raise ValueError(f"--extra-body={args.extra_body!r} is invalid: expected a JSON object") from None
    if "ttft" not in parse_goodput(args.goodput) and args.compare_with:
        raise ValueError(f"--compare-with={args.compare_with!r} needs the SLO: add --goodput ttft:MS")
    try:
        [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles={args.metric_percentiles!r} is invalid: expected e.g. 50,90,99") \
            from None


def run(args: argparse.Namespace) -> int:
    _validate(args)
    args.json = args.json or args.result_file
    check_output_args(args)
    httpx = _httpx()
    try:
        result = asyncio.run(run_benchmark(args))
    except (RuntimeError, OSError, httpx.HTTPError) as e:  # server unreachable, refused the probe, ...
        print(f"rooflm bench serve: error: {e or 'the server did not answer'} ({args.base_url})", file=sys.stderr)
        return 1
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    with report_stream(args):
        print(format_report(result, percentiles, parse_goodput(args.goodput), args.request_rate,
                            args.max_concurrency))
        print(f"Job completion time (ms): mean {result['mean_jct_ms']:.0f}, p50 {result['p50_jct_ms']:.0f}, "
              f"p99 {result['p99_jct_ms']:.0f}")
        if "per_client" in result:
            print(format_clients(result["per_client"]))
        if "priority" in result or "slo" in result:
            print(workloads.format_scheduling(result))
    if result["failed"]:
        first_error = next(e for e in result["errors"] if e)
        print(f"{result['failed']} request(s) failed; first error: {first_error}", file=sys.stderr)
    write_outputs(args, result)
    return 0 if result["completed"] else 1
