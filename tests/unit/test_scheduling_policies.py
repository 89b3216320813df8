"""Scheduling policies without a model: exact admission and preemption order for ``priority``, ``mlfq`` and
``fair``, and a randomized mixed run per policy (every request completes, limits hold every step, no block leaks).

Requests come from the factories of ``test_scheduler``; runner outputs are faked."""
from __future__ import annotations

import random
from collections import deque

import pytest

from rooflm.config import SchedulerConfig
from rooflm.engine.policy import FairPolicy, MLFQPolicy, make_policy
from rooflm.engine.request import RequestStatus
from rooflm.engine.scheduler import Scheduler
from rooflm.kv_cache import KVCacheManager

from unit.test_scheduler import BS, check_limits, fake_output, make_request, step

POLICIES = ("fcfs", "priority", "mlfq", "fair")


def make_scheduler(policy: str, budget=64, max_seqs=8, num_blocks=64, max_model_len=256, prefix=False,
                   **kw) -> Scheduler:
    config = SchedulerConfig(budget, max_seqs, max_model_len, scheduling_policy=policy, **kw)
    return Scheduler(config, KVCacheManager(num_blocks, BS, prefix), eos_token_ids=[0])


def admission_order(s: Scheduler, max_steps: int = 200) -> list[str]:
    """Run to the end; the ids in the order they were first scheduled."""
    order: list[str] = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return order
        out = step(s)
        order += [r.req_id for r in out.new_reqs if r.req_id not in order]
    pytest.fail("the requests did not finish")


def test_unknown_policy_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="scheduling_policy='lifo'"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="mlfq_quantum=0"):
        SchedulerConfig(mlfq_quantum=0)
    with pytest.raises(ValueError, match="fair_output_weight=-1"):
        SchedulerConfig(fair_output_weight=-1)


# -- priority ---------------------------------------------------------------------------------------------------------
def test_priority_admits_by_priority_then_arrival():
    s = make_scheduler("priority", max_seqs=1)
    for rid, prio in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        s.add_request(make_request(rid, 4, max_tokens=1, priority=prio, start=100 * ord(rid)))
    assert admission_order(s) == ["b", "d", "c", "a"]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    s = make_scheduler("fcfs", max_seqs=1)
    for rid, prio in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        s.add_request(make_request(rid, 4, max_tokens=1, priority=prio, start=100 * ord(rid)))
    assert admission_order(s) == ["a", "b", "c", "d"]


def _three_running(policy: str) -> Scheduler:
    """b (priority 1), c (priority 1), a (priority 0) in that arrival order, each 4 prompt tokens (one block) in a
    pool of 4 blocks: after the prefill every one needs a second block and only one is free. (Without
    ``priority_prefill_chunk``, so that all three prompts share the first step.)"""
    s = make_scheduler(policy, num_blocks=4, priority_prefill_chunk=None)
    s.add_request(make_request("b", 4, priority=1, start=200))
    s.add_request(make_request("c", 4, priority=1, start=300))
    s.add_request(make_request("a", 4, priority=0, start=100))
    out = step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b", "c"} and s.kv.num_free_blocks == 1
    return s


def test_priority_preempts_the_lowest_priority_latest_arrival():
    s = _three_running("priority")
    out = step(s)
    assert out.preempted_req_ids == {"c"}  # priority 1 like b, but arrived later
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # batch order: by priority, then arrival


def test_fcfs_preempts_the_latest_admitted_whatever_the_priority():
    s = _three_running("fcfs")
    out = step(s)
    assert out.preempted_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1, "c": 1}


def test_priority_never_preempts_a_higher_priority_request_for_a_lower_one():
    # b (priority 5) arrives first; a (priority 0) second. 3 blocks: both prefill (in one step: no
    # priority_prefill_chunk), then one block for two requests.
    s = make_scheduler("priority", num_blocks=3, priority_prefill_chunk=None)
    s.add_request(make_request("b", 4, priority=5, start=200))
    s.add_request(make_request("a", 4, priority=0, start=100))
    step(s)
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1} and out.preempted_req_ids == {"b"}  # b gives way to itself
    while s.has_unfinished():
        out = step(s)
        assert "a" not in out.preempted_req_ids
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_waiting_higher_priority_request_preempts_when_the_batch_is_full():
    s = make_scheduler("priority", max_seqs=2)
    s.add_request(make_request("a", 4, max_tokens=20, priority=1, start=100))
    s.add_request(make_request("b", 4, max_tokens=20, priority=1, start=200))
    step(s)
    s.add_request(make_request("same", 4, max_tokens=2, priority=1, start=300))
    out = step(s)
    assert out.preempted_req_ids == set() and "same" not in out.num_scheduled_tokens  # equal priority waits
    s.add_request(make_request("urgent", 4, max_tokens=2, priority=0, start=400))
    out = step(s)
    assert out.preempted_req_ids == {"b"}  # the latest arrival of the lowest priority
    assert list(out.num_scheduled_tokens) == ["a", "urgent"]
    assert s.requests["b"].status is RequestStatus.PREEMPTED
    order = admission_order(s)
    assert order.index("b") < order.index("same")  # b arrived before "same": it resumes first


def test_a_waiting_higher_priority_request_preempts_when_the_pool_is_short():
    # 6 blocks: a and b hold 3 each (11-token prompts, room for their first output, computed in one step: no
    # priority_prefill_chunk); urgent needs 1.
    s = make_scheduler("priority", num_blocks=6, priority_prefill_chunk=None)
    s.add_request(make_request("a", 11, max_tokens=8, priority=2, start=100))
    s.add_request(make_request("b", 11, max_tokens=8, priority=3, start=200))
    step(s)
    assert s.kv.num_free_blocks == 0
    s.add_request(make_request("urgent", 3, max_tokens=1, priority=0, start=300))
    out = step(s)
    assert "urgent" in out.num_scheduled_tokens
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1, "urgent": 3}
    assert admission_order(s)[0] == "b"


def _decoding_lows(s: Scheduler, n: int) -> None:
    for i in range(n):
        s.add_request(make_request(f"low{i}", 4, max_tokens=50, priority=1, start=1000 + 100 * i))
    step(s)  # their prompts: now each decodes one token a step


def test_a_high_priority_prompt_gets_its_step_without_lower_priority_prefill():
    s = make_scheduler("priority", budget=64, max_seqs=4)
    _decoding_lows(s, 2)
    s.add_request(make_request("next_low", 12, priority=1, start=500))
    s.add_request(make_request("high", 12, max_tokens=4, priority=0, start=600))
    out = step(s)
    # the lows' decodes run; next_low, with seats and budget free, is not admitted beside high's prompt
    assert out.num_scheduled_tokens == {"low0": 1, "low1": 1, "high": 12}
    out = step(s)
    assert out.num_scheduled_tokens["next_low"] > 1 and out.num_scheduled_tokens["high"] == 1


def test_a_running_lower_priority_prompt_pauses_for_a_high_priority_prompt():
    s = make_scheduler("priority", budget=64, max_seqs=4, priority_prefill_chunk=8)
    s.add_request(make_request("seen", 4, max_tokens=1, priority=0, start=50))  # a better class was seen
    step(s)
    s.add_request(make_request("low", 20, priority=1, start=100))
    assert step(s).num_scheduled_tokens == {"low": 8}  # chunks of priority_prefill_chunk
    s.add_request(make_request("high", 30, max_tokens=2, priority=0, start=200))
    assert step(s).num_scheduled_tokens == {"high": 30}  # low's next chunk waits a step
    assert [step(s).num_scheduled_tokens for _ in range(3)] == [{"high": 1, "low": 8}, {"low": 4}, {"low": 1}]


@pytest.mark.parametrize("chunk,first,chunks", [(16, [{"peer": 40}], [16, 16, 8]),
                                               (None, [{"peer": 40, "later": 24}], [16])])
def test_lower_classes_prompts_are_chunked_once_a_better_class_was_seen(chunk, first, chunks):
    s = make_scheduler("priority", budget=64, priority_prefill_chunk=chunk)
    s.add_request(make_request("first", 40, max_tokens=1, priority=1, start=100))
    assert step(s).num_scheduled_tokens == {"first": 40}  # priority 1 is the best seen so far: not limited
    s.add_request(make_request("high", 4, max_tokens=1, priority=0, start=300))
    step(s)
    assert not s.has_unfinished()
    s.add_request(make_request("later", 40, max_tokens=1, priority=1, start=500))
    s.add_request(make_request("peer", 40, max_tokens=1, priority=0, start=700))  # the best class: not limited
    got = []
    while s.has_unfinished():
        out = step(s)
        got.append(out.num_scheduled_tokens)
    assert got[:1] == first  # with the rules: the best class first, alone
    assert [g["later"] for g in got[1:]] == chunks  # ... then in chunks; without: the step's budget (64) is the limit


def test_lower_classes_share_one_prefill_chunk_per_step():
    s = make_scheduler("priority", budget=64, priority_prefill_chunk=8)
    s.add_request(make_request("seen", 4, max_tokens=1, priority=0, start=50))
    step(s)
    s.add_request(make_request("a", 12, max_tokens=2, priority=1, start=100))
    s.add_request(make_request("b", 12, max_tokens=2, priority=1, start=200))
    got = [step(s).num_scheduled_tokens for _ in range(3)]
    # 8 prompt tokens a step between them; a's decode is not counted
    assert got == [{"a": 8}, {"a": 4, "b": 4}, {"a": 1, "b": 8}]


def test_a_compressed_lower_priority_prompt_keeps_its_chunks():
    from rooflm.kv_cache.compression import KVCompressionConfig

    s = make_scheduler("priority", budget=64, priority_prefill_chunk=8)
    s.compression = KVCompressionConfig(method="streaming", budget=64, sink=4)  # up to 56 new tokens a step
    s.add_request(make_request("seen", 4, max_tokens=1, priority=0, start=50))
    step(s)
    s.add_request(make_request("low", 20, max_tokens=1, priority=1, start=100))
    assert [step(s).num_scheduled_tokens["low"] for _ in range(3)] == [8, 8, 4]


def test_priority_prefill_chunk_is_validated():
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=f"priority_prefill_chunk={bad!r}"):
            SchedulerConfig(priority_prefill_chunk=bad)
    assert SchedulerConfig(priority_prefill_chunk=0).priority_prefill_chunk is None  # the command line's "off"


# -- mlfq -------------------------------------------------------------------------------------------------------------
def test_mlfq_skip_join_picks_the_first_level_from_the_prompt_length():
    p = MLFQPolicy(num_levels=4, quantum=2, skip_join_tokens=8, starvation_steps=100)
    # up to 8 tokens: level 0; each doubling of the limit one level lower; the last level takes the rest.
    assert [p.initial_level(n) for n in (1, 8, 9, 16, 17, 32, 33, 10_000)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_mlfq_demotes_after_each_levels_quantum_of_generated_tokens():
    s = make_scheduler("mlfq", mlfq_num_levels=3, mlfq_quantum=2, mlfq_skip_join_tokens=8)
    s.add_request(make_request("a", 4, max_tokens=12))
    levels = []
    for _ in range(10):
        step(s)
        s.policy.before_schedule(s.waiting, s.running)  # what the next schedule() starts with
        levels.append(s.policy.level["a"])
    # 2 tokens at level 0, then 4 at level 1, then the last level for good.
    assert levels == [0, 1, 1, 1, 1, 2, 2, 2, 2, 2]


def test_mlfq_a_new_short_request_preempts_a_demoted_one():
    s = make_scheduler("mlfq", max_seqs=1, mlfq_quantum=2, mlfq_skip_join_tokens=8)
    s.add_request(make_request("long", 4, max_tokens=30))
    for _ in range(4):
        step(s)
    assert s.policy.level["long"] == 1
    s.add_request(make_request("short", 4, max_tokens=2, start=300))
    out = step(s)
    assert out.preempted_req_ids == {"long"} and list(out.num_scheduled_tokens) == ["short"]
    out = step(s)
    assert list(out.num_scheduled_tokens) == ["short"]  # short finishes here
    out = step(s)
    assert [r.req_id for r in out.new_reqs] == ["long"]  # resumed with its tokens, to be recomputed


def test_fcfs_lets_the_short_request_wait():
    s = make_scheduler("fcfs", max_seqs=1)
    s.add_request(make_request("long", 4, max_tokens=30))
    for _ in range(4):
        step(s)
    s.add_request(make_request("short", 4, max_tokens=2, start=300))
    out = step(s)
    assert out.preempted_req_ids == set() and list(out.num_scheduled_tokens) == ["long"]


def test_mlfq_long_prompt_joins_lower_and_waits_for_short_ones():
    s = make_scheduler("mlfq", max_seqs=1, mlfq_skip_join_tokens=8)
    s.add_request(make_request("long-prompt", 40, max_tokens=1))
    s.add_request(make_request("short-prompt", 4, max_tokens=1, start=500))
    assert admission_order(s) == ["short-prompt", "long-prompt"]


def test_mlfq_starvation_guard_promotes_after_waiting_steps():
    s = make_scheduler("mlfq", max_seqs=1, mlfq_quantum=1000, mlfq_skip_join_tokens=8, mlfq_starvation_steps=3)
    s.add_request(make_request("runner", 4, max_tokens=8))
    s.add_request(make_request("starved", 20, max_tokens=1, start=300))  # skip-joins level 2
    assert s.policy.level["starved"] == 2
    levels = []
    for _ in range(3):
        step(s)
        levels.append(s.policy.level["starved"])
    assert levels == [2, 2, 0]  # the third step it waited promoted it
    assert s.policy.num_promotions == 1
    s.add_request(make_request("later", 4, max_tokens=1, start=600))  # level 0 too, but arrived later
    order = admission_order(s)
    assert order == ["starved", "later"]


def test_mlfq_without_the_guard_a_later_short_request_overtakes():
    s = make_scheduler("mlfq", max_seqs=1, mlfq_quantum=1000, mlfq_skip_join_tokens=8, mlfq_starvation_steps=1000)
    s.add_request(make_request("runner", 4, max_tokens=8))
    s.add_request(make_request("starved", 20, max_tokens=1, start=300))
    for _ in range(3):
        step(s)
    s.add_request(make_request("later", 4, max_tokens=1, start=600))
    assert admission_order(s) == ["later", "starved"]


# -- fair -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, order", [("fair", ["H0", "L0", "H1", "L1", "H2"]),  # counters alternate
                                           ("fcfs", ["H0", "H1", "H2", "L0", "L1"])])  # the heavy client first
def test_fair_alternates_clients_where_fcfs_serves_the_heavy_one_first(policy, order):
    s = make_scheduler(policy, max_seqs=1)
    for i in range(3):
        s.add_request(make_request(f"H{i}", 4, max_tokens=1, user="heavy", start=100 + 10 * i))
    for i in range(2):
        s.add_request(make_request(f"L{i}", 4, max_tokens=1, user="light", start=500 + 10 * i))
    assert admission_order(s) == order


def test_fair_counters_are_the_weighted_service_each_client_received():
    s = make_scheduler("fair", max_seqs=2, fair_input_weight=1.0, fair_output_weight=3.0)
    want: dict[str, float] = {}
    for i, (user, n, m) in enumerate([("x", 5, 3), ("y", 9, 1), ("x", 2, 4), ("z", 7, 2)]):
        s.add_request(make_request(f"r{i}", n, max_tokens=m, user=user, start=50 * i))
        want[user] = want.get(user, 0.0) + n + 3.0 * m
    admission_order(s)
    assert s.policy.counters == want


def test_fair_lifts_a_newly_active_clients_counter():
    p = FairPolicy(1.0, 2.0)
    busy = make_request("b0", 4, user="busy")
    p.add(busy, [])
    p.counters["busy"] = 100.0  # it has been served alone for a while
    queued = [make_request("b1", 4, user="busy")]
    p.add(queued[0], [])
    newcomer = make_request("n0", 4, user="new")
    p.add(newcomer, queued)
    assert p.counters["new"] == 100.0  # no credit banked while it was idle
    p.counters["rich"] = 500.0
    p.add(make_request("r0", 4, user="rich"), queued)
    assert p.counters["rich"] == 500.0  # a lift never lowers a counter
    # Nobody waiting: the lift is to the counter of the client admitted last.
    p.on_admit(busy)
    late = make_request("l0", 4, user="late")
    p.add(late, [])
    assert p.counters["late"] == p.counters["busy"]


# -- every policy -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_completes_every_request_without_leaks(policy, asynchronous):
    rng = random.Random(POLICIES.index(policy) * 2 + asynchronous)
    num_blocks = 24
    s = make_scheduler(policy, budget=12, max_seqs=4, num_blocks=num_blocks, max_model_len=64,
                       prefix=rng.random() < 0.5, mlfq_quantum=3, mlfq_skip_join_tokens=6, mlfq_starvation_steps=20)
    wanted: dict[str, int] = {}
    pending = []
    for i in range(30):
        n, m = rng.randint(1, 30), rng.randint(1, 20)
        pending.append(make_request(f"r{i}", n, max_tokens=m, start=rng.choice([100, 1000 + 40 * i]),
                                    priority=rng.randint(0, 3), user=rng.choice(["u1", "u2", "u3"])))
        wanted[f"r{i}"] = m
    got: dict[str, int] = {rid: 0 for rid in wanted}
    in_flight: deque = deque()
    depth = 2 if asynchronous else 1
    for _ in range(3000):
        if pending and rng.random() < 0.3:
            s.add_request(pending.pop(0))
        out = s.schedule()
        check_limits(s, out)
        assert num_blocks - s.kv.num_free_blocks <= num_blocks
        if not out.is_empty:
            in_flight.append(out)
        if in_flight and (len(in_flight) >= depth or out.is_empty):
            done = in_flight.popleft()
            for o in s.update_from_output(done, fake_output(done)):
                got[o.req_id] += len(o.new_token_ids)
        if not pending and not s.has_unfinished() and not in_flight:
            break
    assert got == wanted, "a request did not complete with exactly max_tokens tokens"
    assert s.kv.num_free_blocks == num_blocks and not s.kv.block_tables, "KV blocks leaked"
    assert not s.waiting and not s.running
    assert s.num_preemptions > 0, "the small pool forced no preemption"
    if policy == "mlfq":
        assert not s.policy.level and not s.policy.waited  # per-request state dropped at finish
    if policy == "fair":
        assert not s.policy.charged_out


def test_make_policy_follows_the_config():
    assert [make_policy(SchedulerConfig(scheduling_policy=p)).name for p in POLICIES] == list(POLICIES)


def test_priority_and_user_are_validated():
    from rooflm.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="priority='high'"):
        SamplingParams(priority="high")
    with pytest.raises(ValueError, match="user=7"):
        SamplingParams(user=7)
    assert SamplingParams(priority=-3, user="alice").clone(n=1).priority == -3
