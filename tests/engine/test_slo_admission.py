"""SLO-aware admission: a request whose predicted time to first token exceeds ``ttft_slo_ms`` is refused at once.
The step-time predictor is injected (a fixed cost per step plus one per token), so every figure is exact and no
test depends on the clock."""
from __future__ import annotations

import pytest

from rooflm.config import EngineConfig
from rooflm.engine.admission import FINISH_REJECTED, SLORejectedError, TTFTPredictor
from rooflm.engine.request import Request
from rooflm.llm import LLM
from rooflm.sampling_params import SamplingParams


def step_time(q_lens, c_lens, rows):
    """10 ms a step plus 1 ms per token computed."""
    return 0.010 + 0.001 * sum(q_lens)


def _req(rid, prompt_len, max_tokens=4, computed=0):
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    r.num_computed_tokens = computed
    return r


def test_prediction_on_an_empty_engine_is_the_chunked_prefill():
    p = TTFTPredictor(step_time, max_num_batched_tokens=8, max_num_seqs=4)
    # 20 tokens in chunks of 8, 8, 4: three steps
    assert p.predict(20, [], []) == pytest.approx(3 * 0.010 + 0.020)


def test_prediction_counts_the_queue_and_the_decodes():
    p = TTFTPredictor(step_time, max_num_batched_tokens=8, max_num_seqs=4)
    running = [_req("d", 5, max_tokens=10, computed=4)]  # decoding: one token a step
    waiting = [_req("w", 10)]
    # step 1: d 1 + w 7; step 2: d 1 + w 3 (samples) + new 4; step 3: d 1 + w 1 + new 2 (samples): 8 + 8 + 4 tokens
    assert p.predict(6, running, waiting) == pytest.approx(3 * 0.010 + 0.020)
    # with one seat the new request waits for d's 10 samples, then w's prompt (8 + 2 tokens, the second step
    # samples) and its 3 more samples
    one = TTFTPredictor(step_time, max_num_batched_tokens=8, max_num_seqs=1)
    slow = one.predict(6, [_req("d", 5, max_tokens=10, computed=4)], [_req("w", 10)])
    assert slow == pytest.approx(10 * step_time([1], [], 1) + step_time([8], [], 0) + step_time([2], [], 1)
                                 + 3 * step_time([1], [], 1) + step_time([6], [], 1))


def test_prediction_stops_at_the_deadline():
    p = TTFTPredictor(step_time, max_num_batched_tokens=8, max_num_seqs=4)
    assert p.predict(8000, [], [], deadline_s=0.05) > 0.05


def test_engine_rejection_leaves_the_engine_untouched(make_engine, mixed_prompts):
    engine = make_engine(ttft_slo_ms=100, max_num_batched_tokens=32)
    engine.admission.step_time = step_time
    prompt = [t for p in mixed_prompts for t in p][:32]  # one step of 32 tokens alone: 42 ms
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", prompt, params)  # one step: 42 ms
    # b: step 1 a 32; step 2 a 1 (a's last sample) + b 31; step 3 b 1 (samples): 42 + 42 + 11 ms
    engine.add_request("b", prompt, params)
    # c: step 1 a 32; step 2 a 1 + b 31; step 3 b 1 + c 31; step 4 b 1 + c 1 (samples): 42 + 42 + 42 + 12 ms
    assert engine.admission.predict(32, engine.scheduler.running, engine.scheduler.waiting) == pytest.approx(0.138)
    with pytest.raises(SLORejectedError, match="ttft_slo_ms=100") as e:
        engine.add_request("c", prompt, params)
    # the replay stops at the first step past the SLO: 126 ms of steps, after the time c spent in add_request so far
    # (no first token was delivered yet: nothing else is added)
    assert e.value.predicted_s - e.value.outside_s == pytest.approx(0.126) and e.value.slo_s == pytest.approx(0.1)
    assert e.value.outside_s >= 0
    assert engine.scheduler.num_waiting == 2 and "c" not in engine.output_processor.parents
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("c", prompt, params)  # the queue drained: admitted now
    while engine.has_unfinished_requests():
        engine.step()


def test_offline_generate_reports_rejected_requests(make_engine, mixed_prompts):
    engine = make_engine(ttft_slo_ms=100, max_num_batched_tokens=32)
    engine.admission.step_time = step_time
    prompt = [t for p in mixed_prompts for t in p][:32]
    outs = LLM.from_engine(engine).generate([prompt] * 3, SamplingParams(temperature=0, max_tokens=2),
                                            use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length", FINISH_REJECTED]
    assert outs[2].outputs[0].token_ids == [] and "predicted time to first token" in outs[2].outputs[0].stop_reason
    assert outs[2].prompt_token_ids == prompt


def test_bad_slo_is_rejected():
    with pytest.raises(ValueError, match="ttft_slo_ms"):
        EngineConfig(ttft_slo_ms=0)


def test_engine_predictor_uses_the_live_roofline(make_engine, mixed_prompts):
    """The engine's own step-time predictor (the live roofline over a low quantile of the fractions recent steps
    reached) works before the first step (no fraction yet) and after it (measured fractions), and admits what fits
    a generous SLO."""
    engine = make_engine(ttft_slo_ms=3_600_000, max_num_batched_tokens=32)
    prompt = [t for p in mixed_prompts for t in p][:32]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert engine.roofline.fraction is None
    first = engine.admission.predict(32, engine.scheduler.running, engine.scheduler.waiting)
    assert first == engine.roofline.predict([32], [32], 1) > 0  # one step, at the roofline's time (fraction 1)
    engine.add_request("a", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    from rooflm.engine.admission import ADMISSION_QUANTILE

    fraction = engine.roofline.fraction_quantile(ADMISSION_QUANTILE)
    assert fraction is not None and fraction > 0
    assert fraction == min(engine.roofline.recent_fractions)  # at most ten steps: the tenth percentile is the slowest
    after = engine.admission.predict(32, engine.scheduler.running, engine.scheduler.waiting)
    assert after == pytest.approx(engine.roofline.predict([32], [32], 1) / fraction)
    engine.add_request("b", prompt, params)  # admitted
    assert engine.scheduler.num_waiting == 1
    while engine.has_unfinished_requests():
        engine.step()


def test_prediction_adds_the_steps_already_launched():
    p = TTFTPredictor(step_time, max_num_batched_tokens=8, max_num_seqs=4)
    running = [_req("d", 5, max_tokens=10, computed=5), _req("e", 3, max_tokens=10, computed=3)]
    base = p.predict(6, running, [])
    # two steps in flight: each a decode step of the two running requests at their current contexts
    assert p.predict(6, running, [], in_flight=2) == pytest.approx(base + 2 * step_time([1, 1], [5, 3], 2))
    assert p.predict(6, [], [], in_flight=2) == p.predict(6, [], [])  # nothing running: nothing to wait for


def test_fraction_quantile_ranks_the_recent_steps():
    """Nearest-rank quantiles of the per-step fractions, over the last RECENT_STEPS steps only; None before a step; a
    bad q names the field."""
    from rooflm.roofline.live import RECENT_STEPS, LiveRoofline

    roof = LiveRoofline.__new__(LiveRoofline)
    roof.reset()
    roof.predict = lambda q, c, r: 1.0  # every step's best time is 1 s: a step of t seconds reached 1 / t
    assert roof.fraction_quantile(0.1) is None
    for t in (10.0, 2.0, 1.25, 1.0, 2.5, 5.0, 1.0, 4.0, 2.0, 1.0):  # fractions 0.1 .. 1.0
        roof.observe([1], [1], 1, t)
    assert roof.fraction_quantile(0.1) == pytest.approx(0.1)
    assert roof.fraction_quantile(0.2) == pytest.approx(0.2)
    assert roof.fraction_quantile(0.5) == pytest.approx(0.5)
    assert roof.fraction_quantile(1.0) == pytest.approx(1.0)
    assert roof.fraction < 0.5  # the mean of times, not of fractions: pulled down by the 10 s step
    for _ in range(RECENT_STEPS):  # the slow steps age out of the window
        roof.observe([1], [1], 1, 1.0)
    assert roof.fraction_quantile(0.1) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="q=0"):
        roof.fraction_quantile(0)


def test_recent_quantile_is_the_nearest_rank_of_the_window():
    from rooflm.engine.admission import RecentQuantile

    r = RecentQuantile(0.9, window=10)
    assert r.value() == 0.0  # nothing learned yet: no time is added
    for ms in range(1, 11):  # 1..10 ms
        r.observe(ms / 1e3)
    assert r.value() == pytest.approx(0.009)  # nearest rank: the 9th of 10
    r.observe(-1.0)  # a clock that went backwards
    r.observe(float("nan"))
    assert len(r) == 10
    for _ in range(9):  # the window keeps the last ten: nine of 50 ms and the 10 ms one
        r.observe(0.050)
    assert r.value() == pytest.approx(0.050)
    assert RecentQuantile(0.5, window=4).value() == 0.0
    with pytest.raises(ValueError, match="q="):
        RecentQuantile(0.0, window=4)
    with pytest.raises(ValueError, match="window="):
        RecentQuantile(0.9, window=0)


def test_check_counts_the_time_before_the_engine_and_the_delivery():
    """The client's TTFT = the time the request spent before reaching the engine (known exactly at admission) + the
    engine's steps (predicted) + the delivery of the first token (a recent high quantile of measured deliveries)."""

    class Sched:
        running: list = []
        waiting: list = []

    p = TTFTPredictor(step_time, max_num_batched_tokens=8, max_num_seqs=4)
    engine_s = p.predict(8, [], [])  # one step: 18 ms
    assert engine_s == pytest.approx(0.018)
    assert p.check("a", 8, Sched, slo_s=0.1) == pytest.approx(engine_s)
    assert p.check("a", 8, Sched, slo_s=0.1, waited_s=0.050) == pytest.approx(0.050 + engine_s)
    for ms in (5, 10, 20, 30, 40, 5, 5, 5, 5, 5):
        p.delivery.observe(ms / 1e3)
    assert p.delivery.value() == pytest.approx(0.030)  # the 9th of the 10 sorted
    assert p.check("a", 8, Sched, slo_s=0.1, waited_s=0.050) == pytest.approx(0.050 + engine_s + 0.030)
    with pytest.raises(SLORejectedError) as e:  # 60 + 18 + 30 ms > 100 ms
        p.check("b", 8, Sched, slo_s=0.1, waited_s=0.060)
    assert e.value.predicted_s == pytest.approx(0.060 + engine_s + 0.030)
    assert e.value.outside_s == pytest.approx(0.060 + 0.030) and "90 ms of it outside" in str(e.value)
    with pytest.raises(SLORejectedError):  # already past the SLO before the engine saw it
        p.check("c", 8, Sched, slo_s=0.1, waited_s=0.2)


def test_engine_counts_the_time_since_the_server_received_the_request(make_engine, mixed_prompts):
    """``arrival_time`` (the server's stamp) is the start of the client's wait: a request that arrived long ago is
    refused although the engine alone would serve it in time, and an admitted request's metrics start there."""
    import time

    engine = make_engine(ttft_slo_ms=100, max_num_batched_tokens=32)
    engine.admission.step_time = step_time
    prompt = [t for p in mixed_prompts for t in p][:32]  # one step alone: 42 ms
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(SLORejectedError) as e:
        engine.add_request("late", prompt, params, arrival_time=time.monotonic() - 10.0)
    assert e.value.predicted_s >= 10.0 + 0.042
    assert engine.scheduler.num_waiting == 0
    arrival = time.monotonic()
    engine.add_request("a", prompt, params, arrival_time=arrival)
    assert engine.scheduler.waiting[0].metrics.arrival_time == arrival
    while engine.has_unfinished_requests():
        engine.step()


def test_async_engine_hands_deliveries_to_admission(make_engine):
    from rooflm.engine.async_engine import AsyncLLMEngine

    engine = make_engine(ttft_slo_ms=100)
    a = AsyncLLMEngine(engine)
    a.observe_first_token_delivery("x", 0.25)
    assert len(engine.admission.delivery) == 1 and engine.admission.delivery.value() == 0.25
    AsyncLLMEngine(make_engine()).observe_first_token_delivery("x", 0.25)  # no admission: nothing to learn
