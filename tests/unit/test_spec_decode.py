"""Speculative decoding's parts without a model: prompt-lookup proposals, verification (greedy exactness and the
distribution of rejection sampling), the cost rule that switches speculation off, the config, and the scheduler's
rollback of rejected draft positions."""
from __future__ import annotations


import pytest
import torch
from unit.stat_checks import chi2_ok

from rooflm.config import SchedulerConfig
from rooflm.engine.request import Request
from rooflm.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from rooflm.engine.scheduler import Scheduler
from rooflm.kv_cache import KVCacheManager
from rooflm.layers.sampler import SamplingMetadata
from rooflm.sampling_params import SamplingParams
from rooflm.spec_decode.config import SpeculativeConfig
from rooflm.spec_decode.ngram import NgramProposer
from rooflm.spec_decode.proposer import PROBE_EVERY, SpeculativeProposer, eligible, expected_tokens
from rooflm.spec_decode.rejection import verify


# -- prompt lookup --------------------------------------------------------------------------------------------------
def test_ngram_continues_the_most_recent_longest_match():
    p = NgramProposer(3, min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 4, 5, 6, 7]
    # suffix [5, 6, 7] occurred at 0..2 -> continue with 8, 9, 1
    assert p.propose(tokens) == [8, 9, 1]
    # only [6, 7] matches at two places; the most recent earlier one (6..7) continues with 4, 5, 6
    assert p.propose([1, 6, 7, 2, 2, 6, 7, 4, 5, 6, 7]) == [4, 5, 6]
    assert p.propose([1, 2, 3, 4]) == []  # no suffix seen before
    assert p.propose([3, 3], k=5) == [3]  # the continuation is cut at the end of the text
    assert p.propose([1, 2, 1], k=0) == []


def test_ngram_respects_min_n():
    assert NgramProposer(2, min_n=2, max_n=3).propose([4, 9, 1, 4]) == []  # only a 1-gram matches
    assert NgramProposer(2, min_n=1, max_n=3).propose([4, 9, 1, 4]) == [9, 1]


# -- config ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [({"method": "medusa2"}, "method"), ({"num_speculative_tokens": 0},
                                        "num_speculative_tokens"), ({"prompt_lookup_min": 3, "prompt_lookup_max": 2},
                                        "prompt_lookup_min"), ({"k": 3}, "unknown field")])
def test_bad_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(bad)


def test_config_from_json_text():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert c.num_speculative_tokens == 3 and c.method == "ngram"
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")


# -- verification ---------------------------------------------------------------------------------------------------
def _md(params: list[SamplingParams]) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(params, [[]] * n, [[]] * n, [None] * n, "cpu")


def test_greedy_verification_keeps_the_matching_prefix_and_the_targets_token():
    v = 10
    # request 0: drafts [3, 4, 5], target argmax per position [3, 4, 9, 2] -> accepts 2, then 9
    # request 1: draft [7], target argmax [7, 1] -> accepts 1, then the bonus 1
    argmax = [3, 4, 9, 2, 7, 1]
    logits = torch.full((6, v), -5.0)
    logits[torch.arange(6), torch.tensor(argmax)] = 5.0
    params = [SamplingParams(temperature=0)] * 6
    tokens, accepted = verify(logits, [[3, 4, 5], [7]], _md(params), [True, True], [None, None])
    assert accepted.tolist() == [2, 1]
    assert tokens.tolist() == [[3, 4, 9, -1], [7, 1, -1, -1]]


def test_greedy_verification_on_the_host_equals_the_tensor_path():
    """All-greedy CPU batches take a list-based path; a batch with one sampled request takes the tensor path, where
    the greedy rows must come out the same (rows do not influence each other)."""
    g = torch.Generator().manual_seed(0)
    v, drafts = 6, [[1, 2, 3], [0], [4, 4], [5, 1, 0, 2]]
    for _ in range(50):
        rows = sum(len(d) + 1 for d in drafts)
        logits = torch.randn(rows + 2, v, generator=g)
        params = [SamplingParams(temperature=0)] * rows + [SamplingParams(temperature=1.0)] * 2
        fast = verify(logits[:rows], drafts, _md(params[:rows]), [True] * 4, [None] * 4)
        mixed = verify(logits, drafts + [[3]], _md(params), [True] * 4 + [False], [None] * 5)
        assert fast[0].tolist() == mixed[0][:4].tolist() and fast[1].tolist() == mixed[1][:4].tolist()


@pytest.mark.parametrize("draft_prob", [0.05, 0.4, 0.9])
def test_rejection_sampling_follows_the_target_distribution(draft_prob):
    """Chain of 2 drafts at temperature 1: the first output token is distributed as p at position 0, and given that
    both drafts were accepted, the extra token as p at position 2 (Leviathan et al. 2023, Theorem 1)."""
    torch.manual_seed(0)
    v, n = 6, 40000
    p0 = torch.tensor([draft_prob, 0.3, 0.2, 0.1, 0.1, 0.3 - draft_prob if draft_prob < 0.3 else 0.0])
    p0 = (p0.clamp(min=0) + 1e-3) / (p0.clamp(min=0) + 1e-3).sum()
    p1 = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.05, 0.05])
    p2 = torch.tensor([0.2, 0.2, 0.2, 0.1, 0.1, 0.2])
    row = torch.stack([p0.log(), p1.log(), p2.log()])  # [3, V] logits of one request (2 drafts)
    logits = row.repeat(n, 1)
    params = [SamplingParams(temperature=1.0, seed=None)] * (3 * n)
    tokens, accepted = verify(logits, [[0, 1]] * n, _md(params), [False] * n, [None] * n)
    first = torch.bincount(tokens[:, 0], minlength=v).float()
    assert chi2_ok(first, p0)
    both = accepted == 2
    assert both.sum() > 1000
    bonus = torch.bincount(tokens[both, 2], minlength=v).float()
    assert chi2_ok(bonus, p2)
    # The acceptance of draft 0 happens with probability p0[0].
    assert abs((accepted >= 1).float().mean().item() - p0[0].item()) < 0.02


def test_seeded_verification_does_not_depend_on_the_batch():
    torch.manual_seed(1)
    v = 50
    mine = torch.randn(3, v)
    other = torch.randn(5, v)
    params = SamplingParams(temperature=0.8, seed=3)

    def run(with_other: bool):
        g = torch.Generator().manual_seed(42)
        if with_other:
            logits = torch.cat([other, mine])
            drafts, greedy, gens = [[1, 2, 3, 4], [7, 8]], [False, False], [None, g]
            n_rows = 8
        else:
            logits, drafts, greedy, gens, n_rows = mine, [[7, 8]], [False], [g], 3
        tokens, accepted = verify(logits, drafts, _md([params] * n_rows), greedy, gens)
        return tokens[-1].tolist(), accepted[-1].item()

    alone = run(False)
    assert run(True)[0][: alone[1] + 1] == alone[0][: alone[1] + 1]


# -- when speculation pays ------------------------------------------------------------------------------------------
def test_expected_tokens():
    assert expected_tokens(4, 0.0) == 1.0
    assert expected_tokens(4, 1.0) == 5.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)


class _FakeRoofline:
    """Per-step time: memory-bound until the step has more than ``knee`` tokens, then linear in tokens."""

    def __init__(self, knee: int) -> None:
        self.knee = knee

    def predict(self, q, c, rows) -> float:
        return max(1.0, sum(q) / self.knee)


def _decode_request(rid: str) -> Request:
    r = Request(rid, [1, 2, 3, 1, 2, 3], SamplingParams(temperature=0, max_tokens=50))
    r.all_token_ids.append(1)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_speculation_switches_off_when_the_roofline_predicts_no_gain():
    config = SpeculativeConfig(num_speculative_tokens=4)
    small = [_decode_request(f"r{i}") for i in range(2)]
    big = [_decode_request(f"r{i}") for i in range(64)]
    proposer = SpeculativeProposer(config, _FakeRoofline(knee=64), max_model_len=100)
    assert proposer.pays(small, 0.5)  # 10 tokens: still memory-bound, a verify step costs one step
    assert not proposer.pays(big, 0.5)  # 320 tokens: 5 steps' cost for 1.94 tokens each


def _in_flight_prefills(max_tokens: list[int]) -> tuple[Scheduler, SchedulerOutput]:
    """A scheduler whose first step (every request's prefill) is scheduled and not read back, and that step: each
    request holds the placeholder of the token it samples."""
    s = Scheduler(SchedulerConfig(1024, 128, 256), KVCacheManager(512, 4, True), eos_token_ids=[0])
    for i, m in enumerate(max_tokens):
        s.add_request(Request(f"r{i}", [1, 2, 3, 1, 2, 3], SamplingParams(temperature=0, max_tokens=m)))
    return s, s.schedule()


def test_will_draft_judges_the_batch_as_it_will_be_once_the_step_in_flight_is_read_back():
    """Under asynchronous scheduling the switch-off is decided before the step in flight is read back: its requests
    count as the decodes they will be (their token in flight in the context); one whose token in flight reaches
    max_tokens will have finished and does not count. After the read-back ``propose`` sees the same batch."""
    from rooflm.engine.stats import EngineStats

    proposer = SpeculativeProposer(SpeculativeConfig(num_speculative_tokens=4), _FakeRoofline(knee=64), 256)
    stats = EngineStats()
    (small, small_step), (big, big_step) = _in_flight_prefills([50] * 2), _in_flight_prefills([50] * 64)
    assert not any(eligible(r) for r in big.running)  # propose itself sees no decode while the tokens are in flight
    assert all(eligible(r, in_flight=True) for r in big.running)
    assert proposer.will_draft(small.running, stats)  # 10 tokens: memory-bound, a verify step costs one step
    assert not proposer.will_draft(big.running, stats)  # 320 tokens: no gain
    for s, step in ((small, small_step), (big, big_step)):  # read back: the decision made before stands
        s.update_from_output(step, ModelRunnerOutput([r.request_id for r in s.running], [[7]] * len(s.running)))
        assert all(eligible(r) for r in s.running)
    assert proposer.will_draft(small.running, stats) and proposer.pays(small.running, 0.5)
    assert not proposer.will_draft(big.running, stats) and not proposer.pays(big.running, 0.5)
    last, _ = _in_flight_prefills([1, 1])  # the token in flight is each request's last
    assert not proposer.will_draft(last.running, stats)
    assert SpeculativeProposer(SpeculativeConfig(auto_disable=False), _FakeRoofline(64), 256).will_draft(
        big.running, stats)


def test_a_skipped_step_drops_old_drafts_and_counts_a_switch_off():
    from rooflm.engine.stats import EngineStats

    proposer = SpeculativeProposer(SpeculativeConfig(num_speculative_tokens=4), _FakeRoofline(knee=64), 256)
    stats = EngineStats()
    proposer.receive({"r0": [4, 5]})
    proposer.skip(_in_flight_prefills([50] * 64)[0].running, stats)
    assert proposer.pending == {} and not proposer.drafting and stats.spec_steps_disabled == 1
    proposer.skip(_in_flight_prefills([1])[0].running, stats)  # nothing would have drafted: not a switch-off
    assert stats.spec_steps_disabled == 1


def _text_request(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens[:-1], SamplingParams(temperature=0, max_tokens=50))
    r.all_token_ids.append(tokens[-1])
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_prompt_lookup_that_finds_nothing_lets_steps_overlap_and_looks_again_now_and_then():
    """Before a step waits for the one in flight to draft, prompt lookup must be expected to find drafts: on text it
    finds nothing in, the verify step would gain nothing, so later steps stay pipelined, with one lookup every
    PROBE_EVERY steps; on text that repeats itself it drafts again."""
    from rooflm.engine.stats import EngineStats

    proposer = SpeculativeProposer(SpeculativeConfig(num_speculative_tokens=4), _FakeRoofline(knee=4096), 256)
    stats = EngineStats()
    fresh = [_text_request(f"r{i}", list(range(100 * i, 100 * i + 9))) for i in range(64)]  # no n-gram repeats
    assert proposer.will_draft(fresh, stats)  # nothing looked up yet: a hit is assumed
    proposer.propose(fresh, stats)
    assert proposer.drafting and not any(r.spec_token_ids for r in fresh) and proposer.hit_rate < 0.02
    decisions = [proposer.will_draft(fresh, stats) for _ in range(2 * PROBE_EVERY)]
    assert decisions == ([False] * (PROBE_EVERY - 1) + [True]) * 2
    assert proposer.pays(fresh, 0.5)  # the synchronous rule alone would have drafted every step
    repeating = [_decode_request(f"q{i}") for i in range(64)]
    for _ in range(3):
        proposer.propose(repeating, stats)
        assert all(r.spec_token_ids for r in repeating)
    assert proposer.hit_rate > 0.5 and proposer.will_draft(repeating, stats)


# -- scheduler ------------------------------------------------------------------------------------------------------
def test_scheduler_schedules_drafts_and_rolls_back_rejected_positions():
    s = Scheduler(SchedulerConfig(64, 8, 256), KVCacheManager(32, 4, True), eos_token_ids=[0])
    s.add_request(Request("a", [10, 11, 12, 13, 14], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a"], [[21]]))
    req = s.requests["a"]
    req.spec_token_ids = [22, 23, 24]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_tokens == {"a": [22, 23, 24]}
    assert req.num_computed_tokens == 9
    outs = s.update_from_output(out, ModelRunnerOutput(["a"], [[22, 30]]))  # 1 draft accepted, then 30
    assert outs[0].new_token_ids == [22, 30]
    assert req.all_token_ids[-3:] == [21, 22, 30]
    assert req.num_computed_tokens == 7 == req.num_tokens - 1  # positions of 23 and 24 are recomputed
    assert (s.num_draft_tokens, s.num_accepted_tokens, s.num_verifications) == (3, 1, 1)
    assert s.schedule().num_scheduled_tokens == {"a": 1}  # drafts are used once


def test_accepted_tokens_after_a_stop_are_dropped():
    s = Scheduler(SchedulerConfig(64, 8, 256), KVCacheManager(32, 4, True), eos_token_ids=[0])
    s.add_request(Request("a", [10, 11, 12], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[23])))
    s.update_from_output(s.schedule(), ModelRunnerOutput(["a"], [[21]]))
    s.requests["a"].spec_token_ids = [22, 23, 24]
    outs = s.update_from_output(s.schedule(), ModelRunnerOutput(["a"], [[22, 23, 24, 25]]))
    assert outs[0].new_token_ids == [22, 23] and outs[0].finish_reason == "stop" and outs[0].stop_reason == 23
    assert not s.has_unfinished() and s.kv.num_free_blocks == s.kv.num_blocks


def test_incremental_index_matches_a_fresh_search():
    """The per-request index, extended token by token, proposes what a fresh index over the whole text does."""
    import random

    rng = random.Random(0)
    tokens: list[int] = []
    p = NgramProposer(3, min_n=2, max_n=4)
    for _ in range(300):
        tokens.append(rng.choice([1, 2, 3, 4, 5]))  # a small vocabulary: many repeats
        got = p.propose(tokens, req_id="r")
        assert got == NgramProposer(3, min_n=2, max_n=4).propose(list(tokens))
    p.retain(set())
    assert p.propose([9, 9, 9], req_id="r") == [9]  # a forgotten request starts a fresh index
