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
    # the replay stops at the first step past the SLO: 126 ms
    assert e.value.predicted_s == pytest.approx(0.126) and e.value.slo_s == pytest.approx(0.1)
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
