"""Asynchronous scheduling is lossless: with step N+1 scheduled before step N's tokens are read back, every request
ends exactly as in the synchronous mode (same tokens, text, finish and stop reasons, logprobs), including stop strings,
stop token ids, EOS, max_tokens, min_tokens, penalties, seeded sampling with n > 1, aborts and preemption."""
from __future__ import annotations

import pytest

from rooflm.sampling_params import SamplingParams

from engine_utils import run


def _workload(tok, prompts):
    eos = tok.eos_token_id
    cases = [
        SamplingParams(temperature=0, max_tokens=12),  # EOS allowed
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[" the", "."]),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[11, 13, 30]),
        SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=[eos] if eos is not None else []),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, n=2, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, max_tokens=10, seed=11, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.8, max_tokens=9, seed=3, ignore_eos=True, frequency_penalty=0.7),
    ]
    return [(prompts[i % len(prompts)], cases[i % len(cases)]) for i in range(2 * len(cases))]


def _summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def _assert_logprobs_close(got, expected):
    """Logprobs agree to float32 rounding: the two modes batch the same requests into different steps, and a matmul's
    last bits depend on the batch around a row."""
    for o, e in zip(got, expected):
        for c, ce in zip(o.outputs, e.outputs):
            assert (c.logprobs is None) == (ce.logprobs is None)
            for d, de in zip(c.logprobs or [], ce.logprobs or []):
                assert d.keys() == de.keys()
                assert all(abs(d[k] - de[k]) < 1e-4 for k in d)


@pytest.mark.parametrize("pool", [None, 20], ids=["roomy", "preempting"])
def test_async_equals_sync(make_engine, smol, mixed_prompts, pool):
    tok = smol[2]
    work = _workload(tok, mixed_prompts[:12])
    kw = dict(max_num_batched_tokens=48, max_model_len=256)
    if pool is not None:
        kw["num_gpu_blocks_override"] = pool
    sync = make_engine(async_scheduling=False, **kw)
    async_ = make_engine(async_scheduling=True, **kw)
    expected = run(sync, [p for p, _ in work], [sp for _, sp in work])
    got = run(async_, [p for p, _ in work], [sp for _, sp in work])
    assert _summary(got) == _summary(expected)
    _assert_logprobs_close(got, expected)
    assert any(o.outputs[0].logprobs for o in got)
    assert any(o.outputs[0].finish_reason == "stop" and isinstance(o.outputs[0].stop_reason, str) for o in got)
    if pool is not None:
        assert async_.get_stats().num_preemptions > 0 and sync.get_stats().num_preemptions > 0


def test_async_lags_one_step_and_stops_at_max_tokens(make_engine, mixed_prompts):
    """The first step of a request returns nothing in asynchronous mode (its token is read back one step later); a
    request whose placeholders already reach max_tokens is not scheduled again, so 3 tokens take exactly 3 steps."""
    engine = make_engine(async_scheduling=True)
    engine.add_request("a", mixed_prompts[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.step() == []  # the prefill was launched; its token is not read back yet
    outs = engine.step()
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
    assert final is not None and final.finished
    assert len(final.outputs[0].token_ids) == 3 and final.outputs[0].finish_reason == "length"
    assert engine.get_stats().num_steps == 3, "a step was scheduled past max_tokens"


def test_abort_while_a_step_is_in_flight(make_engine, mixed_prompts):
    engine = make_engine(async_scheduling=True)
    engine.add_request("a", mixed_prompts[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", mixed_prompts[2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("a")
    seen = set()
    while engine.has_unfinished_requests():
        seen |= {o.request_id for o in engine.step()}
    assert "a" not in seen, "an aborted request produced output after its abort"
    assert "b" in seen


@pytest.mark.parametrize("mode", [False, True], ids=["sync", "async"])
def test_runner_rows_are_released_across_idle_steps(make_engine, mixed_prompts, mode):
    """max_num_seqs rows in the runner's batch: batches that drain completely (idle steps between them) must
    release every row, or the third batch would not fit."""
    engine = make_engine(max_num_seqs=2, async_scheduling=mode)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(3):
        outs = run(engine, mixed_prompts[2 * i:2 * i + 2], params)
        assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
        assert not engine.step() and not engine.has_unfinished_requests()
    assert len(engine.runner.batch.reqs) <= 2
