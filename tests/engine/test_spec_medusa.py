"""Medusa heads (``method: "medusa"``) inside continuous batching are lossless: greedy tokens equal the plain path's on
mixed batches (requests that cannot speculate beside ones that do) with preemption and chunked prefill; seeded
sampling is reproducible; no KV block leaks (checked by the make_engine fixture); heads that do not fit the target
are refused with the field named."""
from __future__ import annotations

import json

import pytest
import torch

from rooflm.sampling_params import SamplingParams
from rooflm.spec_decode.medusa import CONFIG_NAME, MedusaHeads, model_identity, save_medusa_heads

from engine_utils import run, tokens
from test_spec_draft import _params, _summary


def _heads(cfg, num_heads: int, scale: float, seed: int = 0) -> MedusaHeads:
    heads = MedusaHeads(num_heads, cfg.hidden_size)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=g) * scale / cfg.hidden_size ** 0.5)
        heads.bias.copy_(torch.randn(heads.bias.shape, generator=g) * scale)
    return heads


@pytest.fixture(scope="module")
def heads_dir(smol, tmp_path_factory) -> str:
    """Random heads for the default model: proposals that are sometimes right (an untrained head repeats the LM
    head's own prediction) and often wrong; exactness must not depend on them."""
    cfg = smol[1]
    path = tmp_path_factory.mktemp("medusa")
    save_medusa_heads(_heads(cfg, 4, 0.5), path, model_identity(cfg, "SmolLM2-135M"))
    return str(path)


def _spec(path: str, k: int = 3, tree=None) -> dict:
    return {"method": "medusa", "model": path, "num_speculative_tokens": k, "auto_disable": False, "tree": tree}


# Chunked prefill (20 tokens a step) and a pool small enough to preempt (Medusa drafts take no lookahead slots).
SCHEDULE = dict(num_gpu_blocks_override=10, max_model_len=128, max_num_batched_tokens=20, max_num_seqs=4)


_plain: list = []


@pytest.mark.parametrize("tree", [None, "default"], ids=["chain", "tree"])
def test_greedy_medusa_equals_plain_decoding(make_engine, mixed_prompts, heads_dir, tree):
    prompts = mixed_prompts[:8]
    if not _plain:
        plain = make_engine(**SCHEDULE)
        _plain.extend([_summary(run(plain, prompts, _params())), plain.get_stats()])
    expected, plain_stats = _plain
    spec = make_engine(speculative_config=_spec(heads_dir, tree=tree), **SCHEDULE)
    assert _summary(run(spec, prompts, _params())) == expected
    stats = spec.get_stats()
    assert stats.spec_verifications > 0 and stats.spec_draft_tokens > 0, "nothing was speculated"
    assert stats.spec_accepted_tokens > 0 and stats.num_steps < plain_stats.num_steps
    assert stats.num_preemptions > 0 and plain_stats.num_preemptions > 0


def test_seeded_sampling_with_medusa_is_reproducible(make_engine, mixed_prompts, heads_dir):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=8, ignore_eos=True, n=2)
    first = tokens(run(make_engine(speculative_config=_spec(heads_dir)), mixed_prompts[1:3], params))
    engine = make_engine(speculative_config=_spec(heads_dir))
    again = run(engine, mixed_prompts[1:3], params)
    assert tokens(again) == first
    assert all(len(c.token_ids) == 8 for o in again for c in o.outputs)
    assert engine.get_stats().spec_verifications > 0


def test_heads_that_do_not_fit_the_target_are_refused(make_engine, smol, tmp_path):
    cfg = smol[1]
    narrow = tmp_path / "narrow"
    save_medusa_heads(MedusaHeads(2, 32), narrow, {"vocab_size": cfg.vocab_size, "hidden_size": 32})
    with pytest.raises(ValueError, match="speculative_config.model=.*hidden_size=32"):
        make_engine(speculative_config=_spec(str(narrow), 2))
    other_vocab = tmp_path / "vocab"
    save_medusa_heads(MedusaHeads(2, cfg.hidden_size), other_vocab, {"vocab_size": 1000})
    with pytest.raises(ValueError, match="speculative_config.model=.*vocab_size=1000"):
        make_engine(speculative_config=_spec(str(other_vocab), 2))
    with pytest.raises(ValueError, match="num_speculative_tokens=3 is more than the 2 Medusa heads"):
        make_engine(speculative_config=_spec(_two_heads(tmp_path, cfg), 3))
    with pytest.raises(ValueError, match="speculative_config.model=.*not a Medusa heads folder"):
        make_engine(speculative_config=_spec(str(tmp_path / "missing"), 2))
    broken = tmp_path / "broken"
    save_medusa_heads(MedusaHeads(2, cfg.hidden_size), broken, {"vocab_size": cfg.vocab_size})
    (broken / CONFIG_NAME).write_text(json.dumps({"num_heads": 3, "hidden_size": cfg.hidden_size}))
    with pytest.raises(ValueError, match="weight of shape"):
        make_engine(speculative_config=_spec(str(broken), 2))


def _two_heads(tmp_path, cfg) -> str:
    path = tmp_path / "two"
    save_medusa_heads(MedusaHeads(2, cfg.hidden_size), path, model_identity(cfg, None))
    return str(path)


def test_medusa_needs_its_heads_folder():
    from rooflm.spec_decode.config import SpeculativeConfig

    with pytest.raises(ValueError, match="speculative_config.model=None is invalid for method 'medusa'"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="speculative_config.model='x' is only for methods"):
        SpeculativeConfig(method="ngram", model="x")


def test_sampled_tokens_with_a_medusa_tree_follow_the_target(tmp_path):
    """End to end at temperature 1, a 16-token vocabulary: the first two output tokens' joint distribution is the
    target's p(t1) p(t2 | t1), computed directly from the model, although t2 comes out of SpecInfer's multi-candidate
    tree verification against random heads' candidates (chi-square over the 256 pairs)."""
    from test_spec_draft import peaked_target_and_joint
    from unit.stat_checks import chi2_ok

    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine

    target, cfg, prompt, _, joint = peaked_target_and_joint(tmp_path)
    heads = tmp_path / "heads"
    save_medusa_heads(_heads(cfg, 2, 1.0, seed=3), heads, model_identity(cfg, None))
    spec = _spec(str(heads), 2, tree=[[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    engine = LLMEngine(EngineConfig(speculative_config=spec, kv_cache_memory=8 * 2**20, show_progress=False,
                                    seed=1), model=target, model_config=cfg)
    n = 3000
    outputs = run(engine, [prompt] * n, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i)
                                         for i in range(n)])
    pairs = torch.tensor([o.outputs[0].token_ids[0] * 16 + o.outputs[0].token_ids[1] for o in outputs])
    assert chi2_ok(torch.bincount(pairs, minlength=256).float(), joint)
    stats = engine.get_stats()
    assert stats.spec_verifications >= n and stats.spec_accepted_tokens > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_medusa_heads_share_the_native_lm_head_product(tmp_path):
    """On the CPU's native quantized kernel (each row scored on its own) the heads' rows ride in the step's own LM
    head product: the target's logits and the heads' are bit-equal to separate products, and greedy Medusa decoding
    of the default GGUF model kept quantized gives the plain path's tokens while drafting from the fused product."""
    from rooflm.kernels.cpu_native import native_library
    from rooflm.llm import LLM
    from rooflm.spec_decode.medusa import MedusaDrafter, fusable_lm_head

    if native_library() is None:
        pytest.skip("the native CPU kernels do not build on this machine")
    llm = LLM(None, show_progress=False, kv_cache_memory=32 * 2**20, max_num_seqs=4)
    model, cfg = llm.engine.model, llm.engine.model_config
    assert fusable_lm_head(model.lm_head)
    heads = _heads(cfg, 3, 0.5)
    save_medusa_heads(heads, tmp_path / "h", model_identity(cfg, None))
    h = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    spec_llm = LLM(None, show_progress=False, kv_cache_memory=32 * 2**20, max_num_seqs=4,
                   speculative_config=_spec(str(tmp_path / "h"), k=2))
    drafter = spec_llm.engine.runner.drafter
    assert isinstance(drafter, MedusaDrafter) and drafter.fuse
    with torch.inference_mode():
        logits, head_logits = drafter.fused_logits(h)
        assert torch.equal(logits, model.compute_logits(h))
        alone = model.compute_logits(drafter._heads(h, 2).reshape(-1, cfg.hidden_size)).view(3, 2, -1)
        assert torch.equal(head_logits, alone)
        # there the heads' blocks run as 8-bit weights on the native kernel: close to the float heads
        assert drafter.heads_q8 is not None
        ref, q8 = heads(h, 2), drafter._heads(h, 2)
        z_ref, z_q8 = ref - h.unsqueeze(1), q8 - h.unsqueeze(1)  # the blocks' SiLU terms alone
        print("q8 heads: relative error", float((z_q8 - z_ref).norm() / z_ref.norm()))
        assert float((z_q8 - z_ref).norm() / z_ref.norm()) < 0.02
        assert not torch.equal(z_q8, z_ref)
    prompts = ["It is a truth universally acknowledged, that a single man",
               "The Project Gutenberg eBook of Emma, by Jane Austen. Emma Woodhouse, handsome, clever, and rich,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    fused = []
    original = drafter.observe
    drafter.observe = lambda rows, hidden, head_logits=None: (fused.append(head_logits is not None),
                                                               original(rows, hidden, head_logits))
    got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert fused and all(fused), "the heads did not draft from the step's product"
    assert spec_llm.engine.get_stats().spec_verifications > 0
