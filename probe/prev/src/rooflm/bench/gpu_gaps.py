"""GPU idle time between engine steps, from a torch.profiler trace (``rooflm bench latency --profile``).

Each profiled step runs inside ``torch.profiler.record_function(STEP_MARKER)``. A GPU activity (kernel, memcpy,
memset) belongs to the step whose marker contains the CPU call that launched it (the CUDA runtime or driver call with
the same correlation id: kernels of a CUDA graph carry the id of their ``cudaGraphLaunch``), so work that runs on the
GPU after its step returned on the CPU still counts for that step. The idle time between steps n and n+1 is the start
of step n+1's first GPU activity minus the end of step n's last one (0 when they overlap). Pure functions over
microsecond timestamps, so they are tested without a GPU."""
from __future__ import annotations

import bisect
import math
from typing import Any, Iterable, Sequence

STEP_MARKER = "rooflm_step"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def step_gaps_us(activity: Iterable[tuple[float, float, float]], steps: Sequence[tuple[float, float]]) -> list[float]:
    """GPU idle µs between consecutive steps that both ran GPU work.

    activity: (launch_us, start_us, end_us) per GPU activity: the CPU time of its launch, its GPU interval.
    steps: (begin_us, end_us) of each step marker on the CPU, in any order, not overlapping.
    Activity launched outside every step is ignored; a step without GPU work breaks the chain (no gap across it)."""
    order = sorted(steps)
    begins = [b for b, _ in order]
    first: list[float] = [math.inf] * len(order)
    last: list[float] = [-math.inf] * len(order)
    for launch, start, end in activity:
        if end < start:
            raise ValueError(f"activity interval ({start}, {end}) is invalid: end before start")
        i = bisect.bisect_right(begins, launch) - 1
        if i < 0 or launch > order[i][1]:
            continue
        first[i] = min(first[i], start)
        last[i] = max(last[i], end)
    gaps = []
    for i in range(len(order) - 1):
        if last[i] > -math.inf and first[i + 1] < math.inf:
            gaps.append(max(0.0, first[i + 1] - last[i]))
    return gaps


def activity_from_trace(trace: dict[str, Any], marker: str = STEP_MARKER
                        ) -> tuple[list[tuple[float, float, float]], list[tuple[float, float]]]:
    """(activity, steps) for ``step_gaps_us`` from a Chrome trace (``prof.export_chrome_trace``): GPU events with
    their launch's CPU time, matched by correlation id, and the CPU ranges of the ``marker`` annotations. A GPU event
    whose launch was not recorded (some CUDA-graph replays) is placed by its own start time, which falls inside its
    step whenever a step waits for its GPU work before returning (rooflm's engine reads the sampled tokens)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else []
    launches: dict[Any, float] = {}
    gpu: list[tuple[Any, float, float]] = []
    steps: list[tuple[float, float]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, ts, dur = e.get("cat", ""), float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        corr = (e.get("args") or {}).get("correlation")
        if cat in LAUNCH_CATEGORIES and corr is not None:
            launches[corr] = ts
        elif cat in GPU_CATEGORIES:
            gpu.append((corr, ts, ts + dur))
        elif cat == "user_annotation" and e.get("name") == marker:
            steps.append((ts, ts + dur))
    activity = [(launches.get(c, s), s, t) for c, s, t in gpu]
    return activity, steps


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("values is empty: expected at least one value")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q!r} is invalid: expected 0..1")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_gaps(gaps: Sequence[float]) -> dict[str, float | int | None]:
    """Mean, median, p90 and max µs of the gaps (None for each when there are none)."""
    if not gaps:
        return {"gaps": 0, "mean_us": None, "median_us": None, "p90_us": None, "max_us": None}
    return {"gaps": len(gaps), "mean_us": sum(gaps) / len(gaps), "median_us": quantile(gaps, 0.5),
            "p90_us": quantile(gaps, 0.9), "max_us": max(gaps)}
