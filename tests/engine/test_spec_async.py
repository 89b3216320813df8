"""Asynchronous scheduling with speculative decoding is lossless: steps in which speculation is switched off are
pipelined (step N+1 scheduled before step N is read back), and before a step that drafts the step in flight is
finished, so drafts continue from tokens on the host. Tokens and finish reasons equal the synchronous mode's and the
plain path's (no speculation) on mixed batches in which the switch-off flips on and off during the run (an injected
cost model decides it from the batch), with preemption, chunked prefill, prefix hits, requests arriving mid-run, stop
strings, EOS, max_tokens and seeded n = 2 with penalties; no KV block leaks (checked by the make_engine fixture)."""
from __future__ import annotations

import pytest

from rooflm.sampling_params import SamplingParams

from engine_utils import run
from test_spec_decode import _params, echo_prompts  # noqa: F401  (echo_prompts is a fixture)
from test_spec_draft import SCHEDULES, _summary, spec_config, tiny_config  # noqa: F401  (tiny_config: a fixture)
from test_spec_medusa import heads_dir  # noqa: F401  (a fixture)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}  # auto_disable on: the injected cost model decides
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=12, ignore_eos=True,
                        repetition_penalty=1.2, frequency_penalty=0.3)


def _workload() -> list[SamplingParams]:
    """Greedy requests that speculate beside ones that never do (logprobs, penalties, seeded n = 2 with penalties),
    ending by max_tokens, EOS, a stop string, a stop id."""
    return _params() + [SEEDED]


def _decide(rule: str):
    """The injected switch-off: "batch": drafting pays while at most two requests decode; "steps": it pays on the
    steps whose decoding batch holds an even number of blocks of 8 tokens in all (flips nearly every step). Both read
    only what the host knows of the batch, tokens in flight counted, as the roofline's rule does."""
    if rule == "batch":
        return lambda decodes, acceptance: len(decodes) <= 2
    return lambda decodes, acceptance: sum(r.num_tokens for r in decodes) // 8 % 2 == 0


def _make(make_engine, spec, rule: str | None, async_scheduling: bool, **kw):
    engine = make_engine(speculative_config=spec, async_scheduling=async_scheduling, **kw)
    assert engine.async_scheduling is async_scheduling
    if rule is not None:
        engine.proposer.pays = _decide(rule)
    return engine


def _record_launches(engine) -> list[tuple[int, bool, bool]]:
    """Per launched step: (steps still in flight, whether it verifies drafts, whether the runner's drafter may run)."""
    launches = []
    execute = engine.runner.execute

    def recording(out):
        drafter = engine.runner.drafter
        launches.append((len(engine._in_flight), bool(out.scheduled_spec_tokens),
                         engine.proposer.drafting if drafter is None else drafter.enabled))
        return execute(out)

    engine.runner.execute = recording
    return launches


def _check_pipelining(launches: list[tuple[int, bool, bool]]) -> None:
    """Steps overlapped, and never a step that verifies or drafts: it neither starts while another is in flight nor
    stays in flight while the next is launched. Drafting was switched on and off during the run."""
    assert all(in_flight <= 1 for in_flight, _, _ in launches)
    assert sum(in_flight for in_flight, _, _ in launches) > 0, "no step was pipelined"
    for (_, spec, drafting), (in_flight, spec_next, drafting_next) in zip(launches, launches[1:]):
        if in_flight:  # this step was launched while the previous one ran
            assert not spec and not drafting, "a drafting step was still in flight when the next was launched"
            assert not spec_next and not drafting_next, "a drafting step was launched while another was in flight"
    modes = [drafting for _, _, drafting in launches]
    assert any(a and not b for a, b in zip(modes, modes[1:])), "speculation was never switched off"
    assert any(b and not a for a, b in zip(modes, modes[1:])), "speculation was never switched back on"
    assert any(spec for _, spec, _ in launches), "nothing was verified"


@pytest.mark.parametrize("rule", ["batch", "steps"])
@pytest.mark.parametrize("kw", [dict(max_num_seqs=4), dict(num_gpu_blocks_override=14, max_model_len=128),
                                dict(max_num_batched_tokens=20, max_num_seqs=6)],
                         ids=["arrivals", "preempting", "chunked"])
def test_ngram_async_equals_sync_and_plain(make_engine, echo_prompts, rule, kw):
    params = _workload()
    prompts = echo_prompts + echo_prompts[:1]
    plain = _summary(run(make_engine(async_scheduling=False, **kw), prompts, params))
    sync = _make(make_engine, NGRAM, rule, False, **kw)
    assert _summary(run(sync, prompts, params)) == plain
    engine = _make(make_engine, NGRAM, rule, True, **kw)
    launches = _record_launches(engine)
    got = run(engine, prompts, params)
    assert _summary(got) == plain
    _check_pipelining(launches)
    stats = engine.get_stats()
    assert stats.spec_steps_disabled > 0 and stats.spec_accepted_tokens > 0
    if "num_gpu_blocks_override" in kw:
        assert stats.num_preemptions > 0
    assert any(c.finish_reason == "stop" and isinstance(c.stop_reason, str) for o in got for c in o.outputs)
    assert [len(c.token_ids) for c in got[-1].outputs] == [SEEDED.max_tokens] * 2


def _method_spec(method: str, tiny: str, heads: str) -> dict:
    if method == "medusa":
        return {"method": "medusa", "model": heads, "num_speculative_tokens": 3}
    spec = spec_config(method, tiny)
    return {**spec, "auto_disable": True}


@pytest.mark.parametrize("method, schedule", [("tiny", "preempting"), ("self", "chunked"), ("medusa", "roomy")])
def test_model_drafts_async_equal_sync_and_plain(make_engine, mixed_prompts, tiny_config, heads_dir, method,
                                                 schedule):
    """Draft-model, self and Medusa drafts are made in the runner after a drafting step only: never after a pipelined
    one (the drafter is off, and the step in flight is finished before the next drafting step is scheduled)."""
    kw = SCHEDULES[schedule]
    prompts = mixed_prompts[:8]  # prompts 0 and 4 share a 40-token prefix
    params = _workload()[:8] + [SEEDED]
    prompts = prompts + prompts[1:2]
    plain = _summary(run(make_engine(async_scheduling=False, **kw), prompts, params))
    spec = _method_spec(method, tiny_config, heads_dir)
    sync = _make(make_engine, spec, "batch", False, quantization="none", **kw)
    assert _summary(run(sync, prompts, params)) == plain
    engine = _make(make_engine, spec, "batch", True, quantization="none", **kw)
    launches = _record_launches(engine)
    assert _summary(run(engine, prompts, params)) == plain
    _check_pipelining(launches)
    stats = engine.get_stats()
    assert stats.spec_steps_disabled > 0 and stats.spec_verifications > 0
    if schedule == "preempting":
        assert stats.num_preemptions > 0
    elif schedule == "roomy":
        assert stats.prefix_hits > 0


def test_requests_arriving_while_steps_are_in_flight(make_engine, echo_prompts):
    """Requests added between steps join a batch whose mode flips (a pipelined step may be in flight when they
    arrive); each ends as on the plain path."""
    params = _workload()
    plain = _summary(run(make_engine(async_scheduling=False), echo_prompts, params[:len(echo_prompts)]))
    engine = _make(make_engine, NGRAM, "batch", True, max_num_seqs=5)
    launches = _record_launches(engine)
    finished = {}
    pending = list(enumerate(zip(echo_prompts, params)))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i, (prompt, p) = pending.pop(0)
            engine.add_request(str(i), prompt, p)
        for o in engine.step():
            if o.finished:
                assert o.request_id not in finished
                finished[o.request_id] = o
        steps += 1
    assert _summary([finished[str(i)] for i in range(len(echo_prompts))]) == plain
    _check_pipelining(launches)


def test_async_scheduling_is_accepted_with_speculation_and_logged(make_engine):
    from rooflm.config import EngineConfig

    EngineConfig(speculative_config=NGRAM, async_scheduling=True)  # no longer refused
    engine = make_engine(speculative_config=NGRAM, async_scheduling=True)
    assert engine.async_scheduling and engine.proposer is not None
    assert "while speculation is switched off" in engine._scheduling_text()
    assert "synchronous" in make_engine(speculative_config=NGRAM, async_scheduling=False)._scheduling_text()
