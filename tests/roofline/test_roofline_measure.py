"""``--measure`` probes (torch, CPU here): positive, plausible numbers, quickly."""
from __future__ import annotations

from rooflm.roofline import analyze
from rooflm.roofline.measure import measure_bandwidth, measure_matmul_peak


def test_measure_probes_make_a_usable_device():
    bw = measure_bandwidth("cpu", nbytes=32 * 2**20, reps=3)
    key, peak = measure_matmul_peak("cpu", n=256, reps=2)
    assert key == "fp32"
    assert 1e8 < bw < 1e13  # 0.1 GB/s .. 10 TB/s
    assert 1e8 < peak < 1e15
    from rooflm.roofline import Hardware

    hw = Hardware.from_measured(bw / 1e9, {key: peak / 1e12}, memory_gib=8)
    r = analyze("smollm2-135m", hw, batch=1, input_len=64, output_len=2, a_bits=32, w_bits=32, kv_bits=32)
    assert r.prefill.layer("q_proj").compute_dtype == "fp32" and r.request.e2e_s > 0
