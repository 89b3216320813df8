"""Model-based drafting without a full model: rejection sampling against a draft distribution q (Leviathan et al.
2023, Theorem 1: every output token follows the target p whatever q is), the config of the draft methods, the
scheduler's lookahead slots for the draft's KV, and the drafter's per-request budget."""
from __future__ import annotations


import pytest
import torch
from unit.stat_checks import chi2_ok

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
    assert chi2_ok(torch.bincount(tokens[:, 0], minlength=v).float(), P[0])
    first_ok = accepted >= 1
    assert chi2_ok(torch.bincount(tokens[first_ok, 1], minlength=v).float(), P[1])
    both = accepted == 2
    if both.sum() > 500:
        assert chi2_ok(torch.bincount(tokens[both, 2], minlength=v).float(), P[2])
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
    assert d.budget(position=5, num_blocks=3, max_drafts=1) == 1  # one token left to max_tokens after the next


def test_the_drafter_samples_from_q_and_keeps_q():
    """Random rows draw their draft token from q (the request's sampling transform of the draft's logits) and keep
    q for verification; greedy rows take the argmax and keep nothing; a seeded row repeats with its generator."""
    from rooflm.layers.sampler import target_probs
    from rooflm.spec_decode.drafter import DraftRequest, Drafter

    torch.manual_seed(0)
    d = Drafter.__new__(Drafter)
    d.device = torch.device("cpu")
    v, n = 6, 30000
    row_logits = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.0, 1.5])
    logits = torch.cat([row_logits.repeat(n, 1), row_logits.unsqueeze(0)])
    hot = SamplingParams(temperature=0.7, top_k=5)
    reqs = [DraftRequest(f"r{i}", i, 0, [0], hot, None) for i in range(n)]
    reqs.append(DraftRequest("g", n, 0, [0], SamplingParams(temperature=0), None))
    probs: list[list[torch.Tensor]] = [[] for _ in reqs]
    tokens = d._choose(logits, reqs, [False] * n + [True], probs)
    q = target_probs(row_logits.unsqueeze(0), _md([hot]))[0]
    assert q[2] == 0  # top-k 5 removed the least likely token
    assert chi2_ok(torch.bincount(tokens[:n], minlength=v).float(), q)
    assert (tokens[:n] != 2).all()
    assert torch.allclose(probs[0][0], q) and probs[-1] == []
    assert tokens[-1].item() == 1

    def seeded() -> int:
        g = torch.Generator().manual_seed(9)
        r = DraftRequest("s", 0, 0, [0], SamplingParams(temperature=1.0, seed=9), g)
        return d._choose(row_logits.repeat(1, 1), [r], [False], [[]]).item()

    draws = {seeded() for _ in range(5)}
    assert len(draws) == 1


def test_analyzer_adds_the_draft_steps_to_the_prediction():
    """The model drafting for itself costs k decode steps more per verification; its first half of the layers about
    half of that (the embedding and LM head come on top); the speed-up is tokens per verification times a decode
    step over the verify step plus the draft steps."""
    import re

    from rooflm.roofline.cli import speculative_lines
    from rooflm.roofline.hardware import get_hardware
    from rooflm.spec_decode.proposer import expected_tokens

    hw = get_hardware("a6000")
    pattern = r"takes ([\d.]+) ms = [\d.]+x a decode step \(([\d.]+) ms\) \+ 4 draft steps ([\d.]+) ms.*up ([\d.]+)x"
    (same,) = speculative_lines("llama-2-7b", hw, [1], 1024, 4, 0.8, draft_model="llama-2-7b")
    verify, plain, drafting, speedup = (float(x) for x in re.search(pattern, same).groups())
    assert drafting == pytest.approx(4 * plain, rel=0.01)
    assert speedup == pytest.approx(expected_tokens(4, 0.8) * plain / (verify + drafting), rel=0.01)
    (half,) = speculative_lines("llama-2-7b", hw, [1], 1024, 4, 0.8, draft_layers=16)
    _, _, drafting_half, speedup_half = (float(x) for x in re.search(pattern, half).groups())
    assert 0.5 * drafting < drafting_half < 0.6 * drafting
    assert speedup < speedup_half
    with pytest.raises(ValueError, match="--draft-layers"):
        speculative_lines("llama-2-7b", hw, [1], 1024, 4, 0.8, draft_layers=32)


def test_a_draft_step_reads_its_layers_and_the_whole_lm_head(tmp_path):
    """The switch-off's price of a ``self`` draft step: its layers plus the LM head, over a full decode step's."""
    import json

    from rooflm.loader import load_model
    from rooflm.spec_decode.drafter import decode_weight_bytes, weight_bytes

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "tie_word_embeddings": True, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(str(tmp_path / "config.json"), load_format="dummy", dtype=torch.float32, device="cpu",
                          show_progress=False)
    layer = weight_bytes(model.model.layers[0])
    head = weight_bytes(model.lm_head)
    assert head == 512 * 32 * 4  # tied: the embedding's matrix, counted once
    full = decode_weight_bytes(model)
    assert full == 4 * layer + head + weight_bytes(model.model.norm)
    assert decode_weight_bytes(model, 1) == full - 3 * layer
