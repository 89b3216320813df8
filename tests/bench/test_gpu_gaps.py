"""GPU idle time between profiled steps: pure functions over synthetic intervals and traces (no GPU needed)."""
from __future__ import annotations

import pytest

from rooflm.bench.gpu_gaps import STEP_MARKER, activity_from_trace, quantile, step_gaps_us, summarize_gaps
from rooflm.cli import main


def test_gap_is_first_start_of_next_step_minus_last_end_of_this_one():
    steps = [(0.0, 100.0), (200.0, 300.0), (400.0, 500.0)]
    activity = [  # (launch, start, end); launched during a step, run later on the GPU
        (10.0, 50.0, 120.0), (20.0, 120.0, 180.0),  # step 0 ends on the GPU at 180
        (210.0, 230.0, 260.0), (220.0, 265.0, 330.0),  # step 1: 230 .. 330
        (420.0, 345.5, 380.0),  # step 2 starts at 345.5 (its launch is what assigns it)
    ]
    assert step_gaps_us(activity, steps) == pytest.approx([230.0 - 180.0, 345.5 - 330.0])


def test_unsorted_steps_overlap_and_activity_outside_steps():
    steps = [(200.0, 300.0), (0.0, 100.0)]
    activity = [
        (50.0, 60.0, 250.0),  # step 0 runs on the GPU until 250
        (210.0, 240.0, 260.0),  # step 1 starts before step 0 ended: overlap, no idle time
        (150.0, 150.0, 999.0),  # launched between the steps: belongs to none
    ]
    assert step_gaps_us(activity, steps) == [0.0]


def test_a_step_without_gpu_work_breaks_the_chain():
    steps = [(0.0, 10.0), (20.0, 30.0), (40.0, 50.0), (60.0, 70.0)]
    activity = [(1.0, 1.0, 5.0), (41.0, 45.0, 48.0), (61.0, 66.0, 69.0)]
    assert step_gaps_us(activity, steps) == [66.0 - 48.0]
    with pytest.raises(ValueError, match="end before start"):
        step_gaps_us([(1.0, 5.0, 4.0)], steps)


def _x(cat, name, ts, dur, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {}}
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


def test_trace_parsing_matches_launches_by_correlation():
    trace = {"traceEvents": [
        _x("user_annotation", STEP_MARKER, 0.0, 100.0),
        _x("user_annotation", STEP_MARKER, 150.0, 100.0),
        _x("user_annotation", "other", 0.0, 1000.0),
        _x("gpu_user_annotation", STEP_MARKER, 10.0, 500.0),  # the GPU-side copy of a marker: not a CPU range
        _x("cuda_runtime", "cudaGraphLaunch", 20.0, 5.0, corr=1),
        _x("cuda_driver", "cuLaunchKernel", 160.0, 3.0, corr=2),
        _x("cuda_runtime", "cudaMemcpyAsync", 170.0, 3.0, corr=3),
        _x("kernel", "a", 30.0, 40.0, corr=1), _x("kernel", "b", 75.0, 25.0, corr=1),  # step 0 ends at 100
        _x("kernel", "c", 180.0, 10.0, corr=2), _x("gpu_memcpy", "m", 170.0, 4.0, corr=3),  # step 1 from 170
        _x("kernel", "orphan", 105.0, 1.0, corr=99),  # no launch recorded, starts between the steps: no step's
        _x("kernel", "replayed", 200.0, 5.0, corr=98),  # no launch recorded, starts in step 1: counts for it
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1.0},
    ]}
    activity, steps = activity_from_trace(trace)
    assert sorted(steps) == [(0.0, 100.0), (150.0, 250.0)]
    assert sorted(activity) == [(20.0, 30.0, 70.0), (20.0, 75.0, 100.0), (105.0, 105.0, 106.0),
                                (160.0, 180.0, 190.0), (170.0, 170.0, 174.0), (200.0, 200.0, 205.0)]
    assert step_gaps_us(activity, steps) == [70.0]


def test_quantiles_and_summary():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert quantile(xs, 0.5) == 3.0 and quantile(xs, 0.9) == pytest.approx(4.6) and quantile(xs, 1.0) == 5.0
    s = summarize_gaps(xs)
    assert s == {"gaps": 5, "mean_us": 3.0, "median_us": 3.0, "p90_us": pytest.approx(4.6), "max_us": 5.0}
    assert summarize_gaps([])["mean_us"] is None
    with pytest.raises(ValueError, match="q="):
        quantile(xs, 1.5)


def test_profile_without_cuda_is_a_one_line_error_naming_the_flag(capsys):
    rc = main(["bench", "latency", "--model", "smollm2-135m", "--device", "cpu", "--dtype", "float32", "--profile"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--profile" in err and "CUDA" in err and len(err.splitlines()) == 1
