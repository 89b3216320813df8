"""The live roofline: per-step best possible time equals the analyzer's for the same step, is cached per token count,
and the observed fractions add up (overall, histogram, EngineStats, report line)."""
from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from roofline_helpers import round_hw, tiny  # noqa: E402

import rooflm.roofline.live as live_mod  # noqa: E402
from rooflm.config import load_model_config  # noqa: E402
from rooflm.engine.stats import EngineStats  # noqa: E402
from rooflm.roofline import Hardware  # noqa: E402
from rooflm.roofline.analyzer import decode_step_time, prefill_time  # noqa: E402
from rooflm.roofline.hardware import get_hardware  # noqa: E402
from rooflm.roofline.live import FRACTION_BUCKETS, LiveRoofline, roofline_line, roofline_summary  # noqa: E402

OPTS = dict(flash_attention=True, prefill_logits="last")
REL = 1e-9


def _live(model="llama-2-7b", hw="a6000", dtype="float16", **kw) -> tuple[LiveRoofline, object, Hardware]:
    cfg = load_model_config(model) if isinstance(model, str) else model
    hardware = get_hardware(hw) if isinstance(hw, str) else hw
    return LiveRoofline(cfg, dtype, hardware, **kw), cfg, hardware


@pytest.mark.parametrize("hw", ["a6000", "h100-sxm"])
def test_decode_batch_1_at_1024_equals_the_analyzer(hw):
    live, cfg, hardware = _live(hw=hw)
    want = decode_step_time(cfg, hardware, 1, 1024, **OPTS)
    assert live.predict([1], [1024], 1) == pytest.approx(want, rel=REL)


def test_decode_batch_32_equals_the_analyzer_and_bf16_keys_work():
    live, cfg, hardware = _live(model="llama-3-8b", hw="h100-sxm", dtype="bfloat16")
    want = decode_step_time(cfg, hardware, 32, 777, w_bits="bf16", a_bits="bf16", kv_bits="bf16", **OPTS)
    assert live.predict([1] * 32, [777] * 32, 32) == pytest.approx(want, rel=REL)


def test_prefill_equals_the_analyzer_including_compute_bound_attention():
    # a slow-compute device makes long-prompt attention compute-bound: both branches of the closed form are used
    slow = Hardware.from_measured(2000, {"fp16": 5}, memory_gib=80)
    for hw in ("a6000", slow):
        live, cfg, hardware = _live(hw=hw)
        for b, s in ((1, 7), (4, 2048)):
            want = prefill_time(cfg, hardware, b, s, **OPTS)
            assert live.predict([s] * b, [s] * b, b) == pytest.approx(want, rel=REL)


def test_mixed_step_equals_the_operator_by_operator_reference():
    live, cfg, hardware = _live()
    # the reference is the analyzer itself on uniform steps
    assert live.reference_time([1] * 8, [300] * 8, 8) == pytest.approx(
        decode_step_time(cfg, hardware, 8, 300, **OPTS), rel=REL)
    assert live.reference_time([64] * 3, [64] * 3, 3) == pytest.approx(prefill_time(cfg, hardware, 3, 64, **OPTS),
                                                                       rel=REL)
    # one new prompt, one prompt chunk after a cached prefix, a partial chunk not sampled, decodes
    q = [512, 256, 100, 1, 1, 1]
    c = [512, 1280, 100, 40, 2000, 9]
    rows = 5
    assert live.predict(q, c, rows) == pytest.approx(live.reference_time(q, c, rows), rel=REL)


def test_random_steps_match_the_reference_with_and_without_a_sliding_window():
    rng = random.Random(3)
    cfg = load_model_config("mistral-7b")  # sliding window 4096
    for model in (tiny(), tiny(sliding_window=48), cfg):
        for hw in (round_hw(), get_hardware("h100-sxm")):
            live, _, _ = _live(model=model, hw=hw)
            for _ in range(20):
                n = rng.randint(1, 12)
                q = [rng.choice([1, 1, 1, rng.randint(1, 300)]) for _ in range(n)]
                c = [qi + rng.randint(0, 9000) for qi in q]
                rows = rng.randint(0, sum(q))
                assert live.predict(q, c, rows) == pytest.approx(live.reference_time(q, c, rows), rel=REL)


def test_windowed_decode_beyond_the_window_equals_the_analyzer():
    live, cfg, hardware = _live(model="mistral-7b", hw="h100-sxm")
    want = decode_step_time(cfg, hardware, 4, 6000, **OPTS)  # reads only the last 4096 keys
    assert live.predict([1] * 4, [6000] * 4, 4) == pytest.approx(want, rel=REL)
    assert live.predict([1] * 4, [6000] * 4, 4) == pytest.approx(live.predict([1] * 4, [4096] * 4, 4), rel=REL)


def test_cache_per_token_count_and_logit_rows(monkeypatch):
    calls = {"block": 0, "model": 0}
    real_block, real_model = live_mod.block_ops, live_mod.model_ops

    def block_ops(*a, **k):
        calls["block"] += 1
        return real_block(*a, **k)

    def model_ops(*a, **k):
        calls["model"] += 1
        return real_model(*a, **k)

    monkeypatch.setattr(live_mod, "block_ops", block_ops)
    monkeypatch.setattr(live_mod, "model_ops", model_ops)
    live, _, _ = _live()
    base = dict(calls)
    first = live.predict([1] * 32, [1000] * 32, 32)
    after_first = dict(calls)
    assert after_first["block"] == base["block"] + 1 and after_first["model"] == base["model"] + 2
    # same T and rows, other contexts and split: only the closed-form attention changes
    second = live.predict([2] * 16, [3000] * 16, 32)
    assert calls == after_first and live.analyzer_calls == 2
    assert second != first
    live.predict([1] * 32, [5] * 32, 7)  # new row count: only the LM head is built
    assert calls["block"] == after_first["block"] and calls["model"] == after_first["model"] + 1
    assert live.analyzer_calls == 3


def test_observe_accumulates_fractions_histogram_and_stats():
    live, _, _ = _live()
    steps = [([1] * 4, [100, 200, 300, 400], 4), ([64], [64], 1), ([1], [9], 1), ([30, 1], [30, 50], 2)]
    fractions = [0.05, 0.15, 0.95, 1.7]
    preds = [live.predict(*s) for s in steps]
    measured = [p / f for p, f in zip(preds, fractions)]
    got = [live.observe(*s, m) for s, m in zip(steps, measured)]
    assert got == pytest.approx(fractions, rel=1e-12)
    assert live.fraction == pytest.approx(sum(preds) / sum(measured), rel=1e-12)
    assert live.num_steps == 4 and live.last_fraction == pytest.approx(1.7)
    expected = [0] * len(FRACTION_BUCKETS)
    for f in fractions:
        expected[next(i for i, b in enumerate(FRACTION_BUCKETS) if f <= b)] += 1
    assert live.bucket_counts == expected
    assert expected[0] == 1 and expected[-1] == 1  # below 0.1 and above 1 land in the end buckets

    stats = EngineStats()
    assert stats.roofline_fraction is None and roofline_summary(stats) is None
    live.fill_stats(stats)
    assert stats.roofline_fraction == live.fraction and stats.roofline_steps == 4
    assert stats.roofline_bucket_counts == tuple(expected) and stats.roofline_bucket_bounds == FRACTION_BUCKETS
    assert stats.roofline_fraction_sum == pytest.approx(sum(fractions))
    assert stats.roofline_hardware.startswith("NVIDIA RTX A6000 datasheet: 768 GB/s")

    summary = roofline_summary(stats)
    assert summary["fraction"] == pytest.approx(live.fraction) and summary["steps"] == 4
    assert sum(summary["histogram"].values()) == 4
    line = roofline_line(summary)
    assert line.startswith(f"roofline: steps ran at {live.fraction:.1%} of their best possible time (NVIDIA")

    # a later snapshot minus an earlier one covers only the steps between them
    before = EngineStats()
    live.fill_stats(before)
    live.observe([1], [10], 1, live.predict([1], [10], 1) / 0.45)
    live.fill_stats(stats)
    delta = roofline_summary(stats, since=before)
    assert delta["steps"] == 1 and delta["fraction"] == pytest.approx(0.45)
    assert delta["histogram"]["0.5"] == 1 and sum(delta["histogram"].values()) == 1


def test_bad_input_is_a_value_error_naming_it():
    live, _, _ = _live()
    with pytest.raises(ValueError, match="context_lens"):
        live.predict([1, 1], [5], 2)
    with pytest.raises(ValueError, match="query_len <= context_len"):
        live.predict([8, 1], [4, 4], 2)
    with pytest.raises(ValueError, match="query_len"):
        live.predict([0, 2], [4, 4], 1)
    with pytest.raises(ValueError, match="num_logit_rows"):
        live.predict([1, 1], [4, 4], 3)
    with pytest.raises(ValueError, match="measured_seconds"):
        live.observe([1], [4], 1, 0.0)
    with pytest.raises(ValueError, match="dtype"):
        LiveRoofline(tiny(), "complex64", round_hw())


def test_for_engine_uses_the_catalog_or_measures_this_device():
    named = LiveRoofline.for_engine(tiny(), "float16", "cpu", hardware="h100-sxm")
    assert named.hardware == get_hardware("h100-sxm")
    measured = LiveRoofline.for_engine(tiny(), "float32", "cpu")
    assert measured.hardware.kind == "measured" and "fp32" in measured.hardware.peak_ops
    assert measured.predict([1], [10], 1) > 0
    assert "measured:" in measured.describe_hardware()


@pytest.mark.parametrize("tflops", [0.05, 10.0, 1000.0])
def test_prefill_chunk_is_the_longest_prompt_step_within_two_decode_steps(tflops):
    live, _, _ = _live(hw=round_hw(bw_gbs=100.0, tflops=tflops))
    chunk = live.prefill_chunk_tokens()
    decode = live.predict([1], [1], 1)
    assert chunk & (chunk - 1) == 0  # a power of two
    assert live.predict([chunk], [chunk], 1) <= 2 * decode
    assert chunk == 8192 or live.predict([2 * chunk], [2 * chunk], 1) > 2 * decode


def test_prefill_chunk_grows_with_the_compute_per_byte():
    chunks = [_live(hw=round_hw(bw_gbs=100.0, tflops=t))[0].prefill_chunk_tokens() for t in (0.05, 1.0, 20.0)]
    assert chunks[0] < chunks[1] < chunks[2]


def test_tensor_parallel_steps_are_one_gpus_share_and_measured_ceilings_count_collectives_free():
    """Under tensor parallelism every rank runs the same step on its shard: the live bound is one GPU's share. With
    catalogued hardware it equals the analyzer's ``tp`` decode step (collectives over the catalogued link); measured
    ceilings carry no link figure, so the collectives count as free there (a lower bound), never an error."""
    live, cfg, hardware = _live(hw="h100-sxm", tp=2)
    assert live.tp == 2
    assert live.predict([1], [1024], 1) == pytest.approx(decode_step_time(cfg, hardware, 1, 1024, tp=2, **OPTS),
                                                        rel=REL)
    measured = Hardware.from_measured(3000, {"fp16": 700}, memory_gib=80)
    one = LiveRoofline(cfg, "float16", measured).predict([1], [1024], 1)
    two = LiveRoofline(cfg, "float16", measured, tp=2)
    assert two.hardware is measured  # reported as measured
    assert 0.5 * one < two.predict([1], [1024], 1) < 0.52 * one  # half the bytes; norms and the router stay whole

    mixtral = load_model_config("mixtral-8x7b")
    sliced = LiveRoofline(mixtral, "float16", measured, tp=2).predict([1], [512], 1)
    ep = LiveRoofline(mixtral, "float16", measured, tp=2, expert_parallel=True)
    # one token: the busiest of two GPUs holds 1 + 3/7 of the two chosen experts on average, against 1.0 sliced
    expert_s = 3 * mixtral.hidden_size * mixtral.intermediate_size * 2 / 3000e9
    assert ep.predict([1], [512], 1) - sliced == pytest.approx(mixtral.num_hidden_layers * 3 / 7 * expert_s, rel=0.01)
