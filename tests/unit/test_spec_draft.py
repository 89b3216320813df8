"""Model-based drafting without a full model: rejection sampling against a draft distribution q (Leviathan et al.
2023, Theorem 1: every output token follows the target p whatever q is), the config of the draft methods, the
scheduler's lookahead slots for the draft's KV, and the drafter's per-request budget."""
from __future__ import annotations

import math

import pytest
import torch

from rooflm.config import SchedulerConfig
from rooflm.engine.request import Request
from rooflm.engine.sched_output import ModelRunnerOutput
from rooflm.engine.scheduler import Scheduler
from rooflm.kv_cache import KVCacheManager
from rooflm.layers.sampler import SamplingMetadata
from rooflm.sampling_params import SamplingParams
from rooflm.spec_decode.config import SpeculativeConfig
from rooflm.spec_decode.rejection import verify


def _md(params: list[SamplingParams]) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(params, [[]] * n, [[]] * n, [None] * n, "cpu")


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    n = counts.sum().item()
    exp = probs * n
    keep = exp > 5
    chi2 = (((counts - exp) ** 2) / exp)[keep].sum().item()
    dof = int(keep.sum()) - 1
    return chi2 < dof + 6 * math.sqrt(2 * dof)  # ~4 sigma: fails only on a real mismatch


def _norm(t: list[float]) -> torch.Tensor:
    x = torch.tensor(t)
    return x / x.sum()


# The target's distributions at three positions and three draft distributions of different quality at the first two.
P = [_norm([0.05, 0.3, 0.2, 0.1, 0.1, 0.25]), _norm([0.1, 0.6, 0.1, 0.1, 0.05, 0.05]),
     _norm([0.2, 0.2, 0.2, 0.1, 0.1, 0.2])]
QS = {"close": [_norm([0.06, 0.28, 0.22, 0.1, 0.09, 0.25]), _norm([0.12, 0.55, 0.1, 0.1, 0.08, 0.05])],
      "far": [_norm([0.6, 0.02, 0.02, 0.3, 0.03, 0.03]), _norm([0.05, 0.05, 0.6, 0.1, 0.1, 0.1])],
      "missing_mass": [_norm([0.0, 0.5, 0.5, 0.0, 0.0, 0.0]), _norm([0.0, 1.0, 0.0, 0.0, 0.0, 0.0])]}


@pytest.mark.parametrize("q_name", list(QS))
def test_rejection_sampling_with_draft_probabilities_follows_the_target(q_name):
    """Drafts drawn from q: the first output token is distributed as p0, the extra token after two accepted drafts
    as p2, the second output token given an accepted first draft as p1, and the first draft is accepted with
    probability sum_x min(p0(x), q0(x))."""
    torch.manual_seed(0)
    v, n = 6, 40000
    q0, q1 = QS[q_name]
    x0 = torch.multinomial(q0, n, replacement=True)
    x1 = torch.multinomial(q1, n, replacement=True)
    logits = torch.stack([p.log() for p in P]).repeat(n, 1)  # [3n, V]: each request scores 2 drafts + 1
    drafts = torch.stack([x0, x1], dim=1).tolist()
    q = torch.stack([q0, q1])
    params = [SamplingParams(temperature=1.0)] * (3 * n)
    tokens, accepted = verify(logits, drafts, _md(params), [False] * n, [None] * n, [q] * n)
    assert _chi2_ok(torch.bincount(tokens[:, 0], minlength=v).float(), P[0])
    first_ok = accepted >= 1
    assert _chi2_ok(torch.bincount(tokens[first_ok, 1], minlength=v).float(), P[1])
    both = accepted == 2
    if both.sum() > 500:
        assert _chi2_ok(torch.bincount(tokens[both, 2], minlength=v).float(), P[2])
    expected = torch.minimum(P[0], q0).sum().item()
    assert abs(first_ok.float().mean().item() - expected) < 0.02


def test_the_deterministic_case_is_q_one_hot():
    """Passing q = one-hot(draft) gives the prompt-lookup verification exactly (same uniforms and noise)."""
    torch.manual_seed(3)
    v, n = 7, 64
    logits = torch.randn(3 * n, v)
    drafts = torch.randint(0, v, (n, 2)).tolist()
    params = [SamplingParams(temperature=0.9)] * (3 * n)
    one_hot = [torch.nn.functional.one_hot(torch.tensor(d), v).float() for d in drafts]
    torch.manual_seed(11)
    a = verify(logits, drafts, _md(params), [False] * n, [None] * n)
    torch.manual_seed(11)
    b = verify(logits, drafts, _md(params), [False] * n, [None] * n, one_hot)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_greedy_rows_ignore_the_draft_distribution():
    v = 5
    logits = torch.full((3, v), -4.0)
    logits[0, 2] = logits[1, 3] = logits[2, 1] = 4.0
    q = torch.full((2, v), 1.0 / v)
    tokens, accepted = verify(logits, [[2, 4]], _md([SamplingParams(temperature=0)] * 3), [True], [None], [q])
    assert accepted.tolist() == [1] and tokens.tolist() == [[2, 3, -1]]


# -- config -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    ({"method": "ngram", "num_draft_layers": 4}, "num_draft_layers"),
    ({"method": "self", "num_draft_layers": 0}, "num_draft_layers"),
    ({"method": "self", "model": "x"}, "model"),
    ({"method": "draft_model", "model": "x", "load_format": "pickle"}, "load_format"),
    ({"method": "eagle"}, "method")])
def test_bad_draft_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=f"speculative_config.{field}"):
        SpeculativeConfig.parse(bad)


def test_draft_config_from_json():
    c = SpeculativeConfig.parse('{"method": "self", "num_draft_layers": 6, "num_speculative_tokens": 2}')
    assert (c.method, c.num_draft_layers, c.num_speculative_tokens) == ("self", 6, 2)


# -- scheduler lookahead ----------------------------------------------------------------------------------------------
def test_steps_that_sample_reserve_lookahead_slots_for_the_draft():
    block = 4
    s = Scheduler(SchedulerConfig(8, 8, 40), KVCacheManager(32, block, False), eos_token_ids=[0])
    s.num_lookahead_tokens = 3
    s.add_request(Request("long", list(range(1, 11)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    out = s.schedule()  # a prefill chunk of 8 of 10 tokens: it does not sample, no lookahead
    assert out.num_scheduled_tokens == {"long": 8} and len(s.kv.get_block_ids("long")) == 2
    s.update_from_output(out, ModelRunnerOutput([], []))
    out = s.schedule()  # the last 2 prompt tokens sample: slots for 10 tokens + 3 lookahead -> 4 blocks
    assert out.num_scheduled_tokens == {"long": 2} and len(s.kv.get_block_ids("long")) == 4
    s.update_from_output(out, ModelRunnerOutput(["long"], [[5]]))
    s.requests["long"].spec_token_ids = [6, 7, 8]
    out = s.schedule()  # verify 1 + 3 drafts: positions up to 14, plus 3 lookahead -> 17 slots, 5 blocks
    assert out.scheduled_spec_tokens == {"long": [6, 7, 8]} and len(s.kv.get_block_ids("long")) == 5


def test_lookahead_stops_at_max_model_len():
    s = Scheduler(SchedulerConfig(64, 8, 12), KVCacheManager(32, 4, False), eos_token_ids=[0])
    s.num_lookahead_tokens = 4
    s.add_request(Request("a", list(range(1, 11)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    s.schedule()
    assert len(s.kv.get_block_ids("a")) == 3  # 10 + 4 capped at 12 slots


def test_drafter_budget_respects_blocks_and_model_length():
    from rooflm.spec_decode.drafter import Drafter

    d = Drafter.__new__(Drafter)
    d.k, d.block_size, d.max_model_len = 4, 4, 20
    assert d.budget(position=5, num_blocks=3) == 4  # slots 5..8 fit 12
    assert d.budget(position=10, num_blocks=3) == 2  # only slots 10, 11 are held
    assert d.budget(position=17, num_blocks=8) == 2  # verify must stay below position 20
    assert d.budget(position=19, num_blocks=8) == 0
