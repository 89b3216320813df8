"""Scheduler unit tests without a model: requests from a factory, runner outputs faked (vLLM's tests/v1/core style).

Each test asserts the exact schedule: which requests run, how many tokens each gets, and that every step stays within
``max_num_batched_tokens`` and ``max_num_seqs``."""
from __future__ import annotations

import pytest

from rooflm.config import SchedulerConfig
from rooflm.engine.request import Request, RequestStatus
from rooflm.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from rooflm.engine.scheduler import Scheduler
from rooflm.kv_cache import KVCacheManager
from rooflm.sampling_params import SamplingParams

BS = 4  # tokens per block: small, so block arithmetic shows in short prompts


def make_scheduler(budget=16, max_seqs=8, num_blocks=64, max_model_len=256, prefix=True) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, max_seqs, max_model_len), KVCacheManager(num_blocks, BS, prefix),
                     eos_token_ids=[0])


def make_request(rid: str, n_prompt: int, max_tokens: int = 8, start: int = 100, **kw) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(rid, list(range(start, start + n_prompt)), params)


def fake_output(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What a runner would return: one token per sampling request."""
    return ModelRunnerOutput(list(out.sampling_req_ids), [[token] for _ in out.sampling_req_ids])


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    check_limits(s, out)
    s.update_from_output(out, fake_output(out, token))
    return out


def check_limits(s: Scheduler, out: SchedulerOutput) -> None:
    assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens, out.num_scheduled_tokens
    assert out.num_reqs <= s.config.max_num_seqs
    assert len(s.running) <= s.config.max_num_seqs


def test_a_long_prompt_is_split_into_budget_sized_chunks():
    s = make_scheduler(budget=16)
    s.add_request(make_request("a", 50))
    chunks = [step(s).num_scheduled_tokens["a"] for _ in range(4)]
    assert chunks == [16, 16, 16, 2]
    assert s.requests["a"].num_output_tokens == 1  # the last chunk sampled


def test_running_requests_come_first_then_fcfs_admission_under_one_budget():
    s = make_scheduler(budget=16)
    for i, rid in enumerate("abc"):
        s.add_request(make_request(rid, 10, start=100 * (i + 1)))  # distinct prompts: no prefix hits
    first = step(s)
    assert first.num_scheduled_tokens == {"a": 10, "b": 6}  # b's prompt is chunked, c waits
    assert [r.req_id for r in first.new_reqs] == ["a", "b"]
    second = step(s)
    assert second.num_scheduled_tokens == {"a": 1, "b": 4, "c": 10}
    assert list(second.num_scheduled_tokens) == ["a", "b", "c"]  # batch order: running, then admitted
    assert [r.req_id for r in second.new_reqs] == ["c"] and [r.req_id for r in second.cached_reqs] == ["a", "b"]


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(budget=64, max_seqs=2)
    for rid in "abcde":
        s.add_request(make_request(rid, 3, max_tokens=2))
    out = step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c", "d", "e"]
    out = step(s)  # a and b finish at max_tokens=2 in this step
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    out = step(s)
    assert list(out.num_scheduled_tokens) == ["c", "d"]
    assert out.finished_req_ids == {"a", "b"}  # told to the runner on the next step


def test_budget_is_never_exceeded_over_a_mixed_run():
    s = make_scheduler(budget=7, max_seqs=3, num_blocks=40)
    for i, n in enumerate([1, 5, 9, 13, 2, 30, 4]):
        s.add_request(make_request(f"r{i}", n, max_tokens=3, start=10 * i))
    steps = 0
    while s.has_unfinished():
        out = step(s)
        assert out.total_num_scheduled_tokens == min(7, out.total_num_scheduled_tokens) and not out.is_empty
        steps += 1
        assert steps < 200
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_preemption_takes_the_latest_admitted_and_resumes_it_with_its_tokens():
    # 5 blocks of 4 tokens: a and b (8 tokens each, 2 blocks) fit; position 8 needs a third block each.
    s = make_scheduler(budget=32, num_blocks=5, prefix=False)
    s.add_request(make_request("a", 8, max_tokens=3))
    s.add_request(make_request("b", 8, max_tokens=3, start=200))
    step(s)  # both prefilled and sampled once: 4 blocks used, 1 free
    out = step(s)  # a takes the free block for position 8; b needs one too and is preempted
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == {"b"}
    assert s.requests["b"].status is RequestStatus.PREEMPTED and s.requests["b"].num_computed_tokens == 0
    out = step(s)  # a samples its 3rd token and finishes; b needs 3 blocks and only 2 are free until then
    assert out.num_scheduled_tokens == {"a": 1}
    out = step(s)
    (resumed,) = out.new_reqs
    assert resumed.req_id == "b" and resumed.num_computed_tokens == 0
    assert resumed.token_ids == list(range(200, 208)) + [7]  # prompt + its output so far, recomputed
    assert out.num_scheduled_tokens == {"b": 9}
    while s.has_unfinished():
        step(s)
    assert s.num_preemptions == 1 and s.kv.num_free_blocks == s.kv.num_blocks


def test_preempted_request_goes_to_the_front_of_the_queue():
    s = make_scheduler(budget=64, num_blocks=6, prefix=False)
    s.add_request(make_request("a", 8, max_tokens=20))
    s.add_request(make_request("b", 8, max_tokens=20, start=200))
    step(s)
    s.add_request(make_request("c", 4, start=300))
    for _ in range(6):
        out = step(s)
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {"b"}  # the most recently admitted running request
            assert [r.request_id for r in s.waiting][:1] == ["b"]  # ahead of c, which came later
            return
    pytest.fail("the small pool forced no preemption")


def test_prefix_hit_starts_a_new_request_past_its_cached_blocks():
    s = make_scheduler(budget=64)
    s.add_request(make_request("a", 10, max_tokens=1))
    step(s)  # a computes 10 tokens: blocks [0:4] and [4:8] become cached; a finishes at max_tokens=1
    s.add_request(make_request("b", 10, max_tokens=1))  # the same prompt
    out = step(s)
    (new,) = out.new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 2}
    assert s.kv.prefix_hits == 8


def test_block_hashes_are_computed_once_per_block():
    r = make_request("a", 10)
    first = list(r.update_block_hashes(BS))
    assert len(first) == 2
    r.all_token_ids += [1, 2]
    again = r.update_block_hashes(BS)
    assert again[:2] == first and len(again) == 3


def test_only_diffs_cross_after_the_first_step():
    s = make_scheduler(budget=64)
    s.add_request(make_request("a", 6, max_tokens=8))
    first = s.schedule()
    assert [r.req_id for r in first.new_reqs] == ["a"] and first.new_reqs[0].block_ids
    s.update_from_output(first, fake_output(first))
    second = s.schedule()
    assert second.new_reqs == [] and [c.req_id for c in second.cached_reqs] == ["a"]
    assert second.cached_reqs[0].new_block_ids == []  # position 6 is still in block 2
    s.update_from_output(second, fake_output(second))
    s.update_from_output(third := s.schedule(), fake_output(third))
    fourth = s.schedule()  # position 8: a new block
    assert len(fourth.cached_reqs[0].new_block_ids) == 1


def test_async_one_step_lag_uses_placeholders():
    """Step N+1 is scheduled before step N's token is known: the request carries an output placeholder."""
    s = make_scheduler(budget=64)
    s.add_request(make_request("a", 5, max_tokens=3))
    s1 = s.schedule()
    assert s1.sampling_req_ids == ["a"] and s.requests["a"].num_output_placeholders == 1
    s2 = s.schedule()  # before update(s1): one decode token, the placeholder
    assert s2.num_scheduled_tokens == {"a": 1} and s.requests["a"].num_output_placeholders == 2
    s.update_from_output(s1, fake_output(s1, token=21))
    assert s.requests["a"].all_token_ids[-1] == 21 and s.requests["a"].num_output_placeholders == 1
    s3 = s.schedule()
    assert s3.num_scheduled_tokens == {"a": 1}
    s.update_from_output(s2, fake_output(s2, token=22))
    assert s.schedule().is_empty  # 3 outputs counted with the placeholder: nothing more to compute
    outs = s.update_from_output(s3, fake_output(s3, token=23))
    assert outs[0].new_token_ids == [23] and outs[0].finish_reason == "length"
    assert not s.has_unfinished()


def test_tokens_of_a_request_finished_while_in_flight_are_dropped():
    s = make_scheduler(budget=64)
    s.add_request(make_request("a", 5, max_tokens=10))
    s1 = s.schedule()
    s2 = s.schedule()
    s.finish_requests(["a"])  # an abort while both steps are in flight
    assert s.update_from_output(s1, fake_output(s1)) == []
    assert s.update_from_output(s2, fake_output(s2)) == []
    assert s.kv.num_free_blocks == s.kv.num_blocks
    s.add_request(make_request("b", 3, start=500))
    assert s.schedule().finished_req_ids == {"a"}


def test_the_scheduler_never_sees_n():
    with pytest.raises(ValueError, match="n=3"):
        Request("a", [1, 2, 3], SamplingParams(n=3))


def test_finished_ids_wait_for_a_step_the_runner_executes():
    """An empty schedule is not executed, so the ids finished before it must reach the runner with the next step
    (else the runner keeps their rows and its batch overflows)."""
    s = make_scheduler(budget=64)
    s.add_request(make_request("a", 5, max_tokens=1))
    step(s)  # a samples its only token and finishes in update_from_output
    assert not s.has_unfinished()
    assert s.schedule().is_empty  # nothing to run: not executed
    s.add_request(make_request("b", 5, start=300))
    assert s.schedule().finished_req_ids == {"a"}


def test_a_request_preempted_in_an_empty_step_is_removed_from_the_runner_before_it_is_readmitted():
    """Asynchronous scheduling: while step 1 is in flight, "a" waits for its last token and "b" needs a block the
    full pool does not have, so "b" preempts itself and step 2 schedules nothing (the engine does not run an empty
    step). The runner still holds "b": the next step it runs must name "b" as preempted, in the same output that
    sends it again as a new request (the runner removes before it adds)."""
    s = make_scheduler(budget=64, max_seqs=2, num_blocks=2, prefix=False)
    s.add_request(make_request("a", 4, max_tokens=1))
    s.add_request(make_request("b", 4, max_tokens=8, start=200))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 4, "b": 4}
    second = s.schedule()  # before step 1's tokens are back
    assert second.is_empty and s.num_preemptions == 1
    s.update_from_output(first, fake_output(first))  # "a" finishes; "b"'s token arrives while it waits
    third = s.schedule()
    assert [r.req_id for r in third.new_reqs] == ["b"]
    assert third.preempted_req_ids == {"b"} and third.finished_req_ids == {"a"}
    s.update_from_output(third, fake_output(third))
    assert not step(s).preempted_req_ids  # told once
