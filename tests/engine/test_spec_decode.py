"""Speculative decoding (prompt lookup) inside continuous batching is lossless: greedy tokens equal the plain path's on
mixed batches with chunked prefill, prefix caching and preemption; requests that do not speculate (logprobs,
penalties) share the steps unharmed; stop conditions inside an accepted run end the request where plain decoding
would; seeded sampling is reproducible; no KV block leaks (checked by the make_engine fixture)."""
from __future__ import annotations

import pytest

from rooflm.sampling_params import SamplingParams

from engine_utils import run, tokens

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "auto_disable": False}


@pytest.fixture(scope="module")
def echo_prompts(austen_ids) -> list[list[int]]:
    """Prompts that repeat a passage (prompt lookup finds continuations) and plain ones."""
    out = []
    for i in range(8):
        passage = austen_ids[30 * i: 30 * i + 40]
        out.append(passage + austen_ids[500:510] + passage[:12] if i % 2 == 0 else austen_ids[700 + 20 * i:740 + 20 * i])
    return out


def _params():
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=24),  # EOS allowed
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[" the"]),
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),  # does not speculate
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.2),  # nor this
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=5),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[28])]


@pytest.mark.parametrize("kw", [dict(), dict(num_gpu_blocks_override=14, max_model_len=128),
                                dict(max_num_batched_tokens=20)], ids=["roomy", "preempting", "chunked"])
def test_greedy_speculation_equals_plain_decoding(make_engine, echo_prompts, kw):
    plain = make_engine(**kw)
    spec = make_engine(speculative_config=SPEC, **kw)
    params = _params()
    expected = run(plain, echo_prompts, params)
    got = run(spec, echo_prompts, params)
    summary = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in got]
    assert summary == [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in expected]
    stats = spec.get_stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0, "nothing was speculated"
    assert stats.num_steps < plain.get_stats().num_steps
    if "num_gpu_blocks_override" in kw:
        assert stats.num_preemptions > 0


def test_seeded_sampling_with_speculation_is_reproducible(make_engine, echo_prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=20, ignore_eos=True, n=2)
    first = tokens(run(make_engine(speculative_config=SPEC), echo_prompts[:4], params))
    engine = make_engine(speculative_config=SPEC)
    again = run(engine, echo_prompts[:4], params)
    assert tokens(again) == first
    assert all(len(c.token_ids) == 20 for o in again for c in o.outputs)
    assert engine.get_stats().spec_verifications > 0


def test_an_unknown_method_is_refused():
    from rooflm.config import EngineConfig

    with pytest.raises(ValueError, match="speculative_config.method"):
        EngineConfig(speculative_config={"method": "lookahead"})
