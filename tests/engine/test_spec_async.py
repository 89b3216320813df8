"""Asynchronous scheduling with speculative decoding is lossless: steps in which speculation is switched off are
pipelined (step N+1 scheduled before step N is read back), and before a step that drafts the step in flight is
finished, so drafts continue from tokens on the host. Tokens and finish reasons equal the synchronous mode's and the
plain path's (no speculation) on mixed batches in which the switch-off flips on and off during the run (an injected
cost model decides it from the batch), with preemption, chunked prefill, prefix hits, requests arriving mid-run, stop
strings, EOS, max_tokens and seeded n = 2 with penalties; no KV block leaks (checked by the make_engine fixture)."""
from __future__ import annotations

import pytest

from rooflm.sampling_params import SamplingParams

from engine_utils import check_pipelining, record_launches, run
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
        return lambda decodes, *cost: len(decodes) <= 2
    return lambda decodes, *cost: sum(r.num_tokens for r in decodes) // 8 % 2 == 0


def _make(make_engine, spec, rule: str | None, async_scheduling: bool, **kw):
    engine = make_engine(speculative_config=spec, async_scheduling=async_scheduling, **kw)
    assert engine.async_scheduling is async_scheduling
    if rule is not None:
        engine.proposer.pays = _decide(rule)
    return engine


@pytest.mark.parametrize("rule", ["batch", "steps"])
@pytest.mark.parametrize("kw", [dict(max_num_seqs=4), dict(num_gpu_blocks_override=14, max_model_len=128),
                                dict(max_num_batched_tokens=20, max_num_seqs=6)],
                         ids=["arrivals", "preempting", "chunked"])
def test_ngram_async_equals_sync_and_plain(make_engine, echo_prompts, rule, kw):  # noqa: F811 (fixtures)
    params = _workload()
    prompts = echo_prompts + echo_prompts[:1]
    plain = _summary(run(make_engine(async_scheduling=False, **kw), prompts, params))
    sync = _make(make_engine, NGRAM, rule, False, **kw)
    assert _summary(run(sync, prompts, params)) == plain
    engine = _make(make_engine, NGRAM, rule, True, **kw)
    launches = record_launches(engine)
    got = run(engine, prompts, params)
    assert _summary(got) == plain
    check_pipelining(launches)
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
def test_model_drafts_async_equal_sync_and_plain(make_engine, mixed_prompts, tiny_config, heads_dir, method,  # noqa: F811
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
    launches = record_launches(engine)
    assert _summary(run(engine, prompts, params)) == plain
    check_pipelining(launches)
    stats = engine.get_stats()
    assert stats.spec_steps_disabled > 0 and stats.spec_verifications > 0
    if schedule == "preempting":
        assert stats.num_preemptions > 0
    elif schedule == "roomy":
        assert stats.prefix_hits > 0


def test_requests_arriving_while_steps_are_in_flight(make_engine, echo_prompts):  # noqa: F811 (a fixture)
    """Requests added between steps join a batch whose mode flips (a pipelined step may be in flight when they
    arrive); each ends as on the plain path."""
    params = _workload()
    plain = _summary(run(make_engine(async_scheduling=False), echo_prompts, params[:len(echo_prompts)]))
    engine = _make(make_engine, NGRAM, "batch", True, max_num_seqs=5)
    launches = record_launches(engine)
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
    check_pipelining(launches)


def test_async_scheduling_is_accepted_with_speculation_and_logged(make_engine):
    from rooflm.config import EngineConfig

    EngineConfig(speculative_config=NGRAM, async_scheduling=True)  # no longer refused
    engine = make_engine(speculative_config=NGRAM, async_scheduling=True)
    assert engine.async_scheduling and engine.proposer is not None
    assert "while speculation is switched off" in engine._scheduling_text()
    assert "synchronous" in make_engine(speculative_config=NGRAM, async_scheduling=False)._scheduling_text()


def test_prompt_lookup_finding_nothing_keeps_steps_pipelined(make_engine):
    """The roofline's own rule, no injected decision: on random prompt tokens prompt lookup first finds nothing, so
    the following steps overlap (a drafting step would wait for the step in flight to gain nothing); a lookup every
    PROBE_EVERY steps finds the repetitions the model's greedy output falls into later, and drafts. The roofline is
    a fixed memory-bound one (a verify step costs a decode step), so the decisions do not depend on this machine."""
    import torch

    from rooflm.spec_decode.proposer import PROBE_EVERY
    from unit.test_spec_decode import _FakeRoofline

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (int(n),), generator=g).tolist() for n in torch.randint(5, 60, (8,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _summary(run(make_engine(async_scheduling=False), prompts, params))
    engine = make_engine(speculative_config=NGRAM, async_scheduling=True)
    engine.proposer.roofline = _FakeRoofline(knee=4096)
    launches = record_launches(engine)
    assert _summary(run(engine, prompts, params)) == plain
    check_pipelining(launches)
    # launch 0: the prefills; 1: the first decodes look up (nothing found); then pipelined steps until a probe
    drafting = [d for _, _, d in launches[1:2 + PROBE_EVERY]]
    assert drafting == [True] + [False] * (PROBE_EVERY - 1) + [True], "steps waited for lookups that found nothing"
    assert all(in_flight == 1 for in_flight, _, _ in launches[3:1 + PROBE_EVERY])
    assert engine.get_stats().spec_accepted_tokens > 0
