"""Speculative decoding with a draft model (``draft_model``) and with the model's own first layers (``self``) is
lossless inside continuous batching: greedy tokens equal the plain path's on mixed batches (requests that cannot
speculate beside ones that do) with preemption, chunked prefill and prefix caching; seeded sampling is reproducible;
no KV block leaks (checked by the make_engine fixture). The model as its own draft has its greedy drafts accepted."""
from __future__ import annotations

import json

import pytest

from rooflm.loader import default_model_path
from rooflm.sampling_params import SamplingParams

from engine_utils import run, tokens

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    """A random 2-layer Llama with the default model's vocabulary (a bad draft: exactness must not depend on it)."""
    path = tmp_path_factory.mktemp("draft") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def spec_config(method: str, tiny: str) -> dict:
    base = {"num_speculative_tokens": 3, "auto_disable": False}
    if method == "self":  # a third of the layers: cheap, often rejected
        return {"method": "self", "num_draft_layers": 10, **base}
    if method == "same_model":  # the model drafts for itself: nearly every greedy draft is accepted
        return {"method": "draft_model", "model": default_model_path(), **base}
    return {"method": "draft_model", "model": tiny, "load_format": "dummy", **base}


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=20),  # EOS allowed
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[" the"]),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),  # does not speculate
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.2),  # nor this
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, min_tokens=5),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[28])]


def _summary(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


# At most 4 running requests: prompt 4 is admitted after prompt 0's blocks are cached, and hits them.
SCHEDULES = {"roomy": dict(max_num_seqs=4), "preempting": dict(num_gpu_blocks_override=14, max_model_len=128,
                                                               max_num_seqs=4),
             "chunked": dict(max_num_batched_tokens=20, max_num_seqs=4)}
_plain_cache: dict[str, list] = {}


@pytest.mark.parametrize("method, schedule", [("same_model", "roomy"), ("same_model", "preempting"),
                                              ("self", "preempting"), ("self", "chunked"),
                                              ("tiny", "preempting")])
def test_greedy_draft_speculation_equals_plain_decoding(make_engine, mixed_prompts, tiny_config, method, schedule):
    kw = SCHEDULES[schedule]
    prompts = mixed_prompts[:8]  # prompts 0 and 4 share a 40-token prefix
    if schedule not in _plain_cache:
        _plain_cache[schedule] = _summary(run(make_engine(**kw), prompts, _params()))
    spec = make_engine(speculative_config=spec_config(method, tiny_config), quantization="none", **kw)
    assert _summary(run(spec, prompts, _params())) == _plain_cache[schedule]
    stats = spec.get_stats()
    assert stats.spec_verifications > 0 and stats.spec_draft_tokens > 0, "nothing was speculated"
    if schedule == "preempting":
        assert stats.num_preemptions > 0
    else:  # (a pool of 14 blocks evicts the shared prefix before prompt 4 arrives)
        assert stats.prefix_hits > 0
    if method == "same_model":
        assert stats.spec_acceptance_rate > 0.9, "the model's own greedy drafts should be accepted"


@pytest.mark.parametrize("method", ["same_model", "self"])
def test_seeded_sampling_with_a_draft_is_reproducible(make_engine, mixed_prompts, tiny_config, method):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True, n=2)
    prompts = mixed_prompts[:3]
    first = tokens(run(make_engine(speculative_config=spec_config(method, tiny_config), quantization="none"),
                       prompts, params))
    engine = make_engine(speculative_config=spec_config(method, tiny_config), quantization="none")
    again = run(engine, prompts, params)
    assert tokens(again) == first
    assert all(len(c.token_ids) == 16 for o in again for c in o.outputs)
    stats = engine.get_stats()
    assert stats.spec_verifications > 0
    if method == "same_model":  # sampled drafts from the target's own distribution: p / q = 1, all accepted
        assert stats.spec_acceptance_rate > 0.9


def test_a_draft_with_another_vocabulary_is_refused(make_engine, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "vocab_size": 1000}))
    with pytest.raises(ValueError, match="speculative_config.model"):
        make_engine(speculative_config={"method": "draft_model", "model": str(path), "load_format": "dummy"})


def test_self_draft_needs_fewer_layers_than_the_model(make_engine):
    with pytest.raises(ValueError, match="num_draft_layers=30"):
        make_engine(speculative_config={"method": "self", "num_draft_layers": 30})


def _small_llama(tmp_path, name: str, layers: int) -> str:
    cfg = {**TINY, "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
           "max_position_embeddings": 64}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def peaked_target_and_joint(tmp_path):
    """A random 2-layer model of ``_small_llama``'s 16-token vocabulary with its LM head scaled up (peaked, so that a
    wrong acceptance rule shows), a prompt, and the target's p(t1) [16] and joint p(t1) p(t2 | t1) [256] after it,
    computed directly from the model: what the chi-square tests of sampled speculation compare against."""
    import torch

    from rooflm.attention.metadata_utils import allocate_kv_caches, single_sequence_metadata
    from rooflm.loader import load_model

    target, cfg = load_model(_small_llama(tmp_path, "target", 2), load_format="dummy", dtype=torch.float32,
                             device="cpu", show_progress=False)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)  # tied to the embedding
    prompt = [3, 7, 1]

    def probs(ids: list[int]) -> torch.Tensor:
        caches = allocate_kv_caches(cfg.num_hidden_layers, 1, 16, cfg.num_key_value_heads, cfg.head_dim)
        meta, pos = single_sequence_metadata(0, len(ids), 16)
        with torch.inference_mode():
            hidden = target(torch.tensor(ids), pos, caches, meta)
            return torch.softmax(target.compute_logits(hidden[-1:]), dim=-1)[0]

    p1 = probs(prompt)
    joint = torch.stack([p1[a] * probs(prompt + [a]) for a in range(16)]).flatten()
    return target, cfg, prompt, p1, joint


def test_sampled_tokens_with_a_draft_model_follow_the_target(tmp_path):
    """End to end at temperature 1, a 16-token vocabulary: the first two output tokens' joint distribution is the
    target's p(t1) p(t2 | t1), computed directly from the model, although t2 always comes out of rejection sampling
    against a different (random 1-layer) draft model's distribution (chi-square over the 256 pairs)."""
    import math

    import torch

    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine

    target, cfg, prompt, p1, joint = peaked_target_and_joint(tmp_path)
    assert p1.max() > 0.2  # not uniform: a wrong acceptance rule would show
    spec = {"method": "draft_model", "model": _small_llama(tmp_path, "draft", 1), "load_format": "dummy",
            "num_speculative_tokens": 2, "auto_disable": False}
    engine = LLMEngine(EngineConfig(speculative_config=spec, kv_cache_memory=8 * 2**20, show_progress=False,
                                    seed=1), model=target, model_config=cfg)
    n = 4000
    outputs = run(engine, [prompt] * n, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i)
                                         for i in range(n)])
    pairs = torch.tensor([o.outputs[0].token_ids[0] * 16 + o.outputs[0].token_ids[1] for o in outputs])
    counts = torch.bincount(pairs, minlength=256).float()
    exp = joint * n
    keep = exp > 5
    chi2 = (((counts - exp) ** 2) / exp)[keep].sum().item()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof)
    stats = engine.get_stats()
    assert stats.spec_verifications >= n and 0 < stats.spec_acceptance_rate < 0.9
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
