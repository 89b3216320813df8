"""Per-client service and job completion time for ``rooflm bench serve`` (the scheduling workloads).

Service is counted as the Virtual Token Counter counts it (Sheng et al. 2024): ``w_in`` per prompt token and
``w_out`` per generated token. Fairness is only meaningful while every client has work queued, so each client's
service is taken over the *backlogged window*: from the start of the run to the moment the first client has all its
requests completed. A prompt counts once its first token arrived inside the window; output tokens count as they
stream in (each text chunk's share of the request's output tokens).

Job completion time (JCT) is the end-to-end latency of a request (send to last byte), per client and overall.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Protocol

from rooflm.bench.datasets import HEAVY_CLIENT


class ClientResult(Protocol):
    success: bool
    user: str | None
    start: float  # seconds from the start of the run to the send
    ttft: float
    itl: list[float]
    latency: float
    prompt_len: int
    output_len: int


def percentile(xs: Sequence[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (0 when empty), interpolating linearly between closest ranks (numpy's
    default)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def jct_stats(latencies_s: Sequence[float]) -> dict[str, float]:
    ms = [x * 1000 for x in latencies_s]
    return {"mean_jct_ms": statistics.fmean(ms) if ms else 0.0, "p50_jct_ms": percentile(ms, 50),
            "p99_jct_ms": percentile(ms, 99)}


def _service_by(r: ClientResult, t: float, w_in: float, w_out: float) -> float:
    if not r.success or r.start + r.ttft > t:
        return 0.0
    chunk_times = [r.start + r.ttft]
    for gap in r.itl:
        chunk_times.append(chunk_times[-1] + gap)
    streamed = sum(1 for c in chunk_times if c <= t)
    return w_in * r.prompt_len + w_out * r.output_len * streamed / len(chunk_times)


def per_client_metrics(results: Sequence[ClientResult], w_in: float = 1.0, w_out: float = 2.0) -> dict[str, Any]:
    """{"window_s", "clients": {user: {requests, service, share, mean/p50/p99_jct_ms}}, "light_heavy_service_ratio"}
    for results that name their client; {} when none does."""
    users = sorted({r.user for r in results if r.user is not None})
    if not users:
        return {}
    finished = {u: max(r.start + r.latency for r in results if r.user == u) for u in users}
    window = min(finished.values())
    clients: dict[str, dict[str, float]] = {}
    for u in users:
        mine = [r for r in results if r.user == u]
        service = sum(_service_by(r, window, w_in, w_out) for r in mine)
        clients[u] = {"requests": len(mine), "service": service,
                      **jct_stats([r.latency for r in mine if r.success])}
    total = sum(c["service"] for c in clients.values()) or 1.0
    for c in clients.values():
        c["share"] = c["service"] / total
    out: dict[str, Any] = {"window_s": window, "clients": clients}
    light = [c["service"] for u, c in clients.items() if u != HEAVY_CLIENT]
    if HEAVY_CLIENT in clients and light and clients[HEAVY_CLIENT]["service"] > 0:
        # Fairness target: each light client within 2x of the heavy one means this ratio >= 0.5.
        out["light_heavy_service_ratio"] = min(light) / clients[HEAVY_CLIENT]["service"]
    return out


def format_clients(m: dict[str, Any]) -> str:
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Per-client service ", n=w, c="-"),
             f"Backlogged window (s): {m['window_s']:.2f}",
             f"{'client':<12}{'reqs':>5}{'share':>8}{'mean JCT':>10}{'p50 JCT':>9}{'p99 JCT':>9}  (ms)"]
    for u, c in m["clients"].items():
        lines.append(f"{u:<12}{c['requests']:>5}{c['share']:>8.3f}{c['mean_jct_ms']:>10.0f}{c['p50_jct_ms']:>9.0f}"
                     f"{c['p99_jct_ms']:>9.0f}")
    if "light_heavy_service_ratio" in m:
        lines.append(f"Least light client's service / heavy client's: {m['light_heavy_service_ratio']:.3f}")
    return "\n".join(lines)
