"""Tensor parallelism over two CPU processes (gloo) gives what one process gives.

The tiny checkpoint splits unevenly everywhere (one KV head replicated on both ranks, a vocabulary of 131 rows) and
has every bias; the default model (SmolLM2-135M, float32) has 9 query heads over 3 KV heads, split 6 + 3."""
from __future__ import annotations

import pytest

from tp_helpers import run
from rooflm.sampling_params import SamplingParams

PROMPTS = [[5, 9, 17, 3, 3, 8], [100, 2], [7] * 23, [42, 11, 130, 64, 0, 1, 2, 3, 4], [88]]


def _logprob_rows(out) -> list[dict[int, float]]:
    return [row for row in out.prompt_logprobs or [] if row is not None] + list(out.outputs[0].logprobs)


def _assert_same(ref: dict, got: dict, tol: float) -> None:
    assert sorted(ref) == sorted(got)
    for rid in ref:
        assert got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids, rid
        a, b = _logprob_rows(ref[rid]), _logprob_rows(got[rid])
        assert len(a) == len(b) > 0
        for ra, rb in zip(a, b):
            assert sorted(ra) == sorted(rb)
            # relative to the logprob's size: float32 keeps about 7 digits, and a very unlikely token's logprob runs
            # to -100 and beyond, where one unit in the last place is already above 1e-5
            assert max(abs(ra[t] - rb[t]) / max(1.0, abs(ra[t])) for t in ra) <= tol


def test_tiny_model_tp2_equals_tp1_greedy_and_seeded(make_engine, tiny_checkpoint):
    greedy = SamplingParams(max_tokens=10, temperature=0, logprobs=3, prompt_logprobs=2)
    seeded = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7 + i, logprobs=1) for i in range(3)]
    ref_engine = make_engine(model=tiny_checkpoint)
    ref_greedy = run(ref_engine, PROMPTS, greedy)
    ref_seeded = run(ref_engine, PROMPTS[:3], seeded)
    tp = make_engine(model=tiny_checkpoint, tensor_parallel_size=2)
    attn = tp.model.model.layers[0].self_attn
    # the KV head is replicated: each rank holds it and 2 of the 4 query heads; the vocabulary splits 66 + 65
    assert (attn.num_heads, attn.num_kv_heads, tp.model.lm_head.out_features) == (2, 1, 66)
    # the live roofline bounds each step by one GPU's share (tests/roofline/test_roofline_live.py checks its value)
    assert (tp.roofline.tp, ref_engine.roofline.tp) == (2, 1)
    _assert_same(ref_greedy, run(tp, PROMPTS, greedy), tol=1e-5)
    _assert_same(ref_seeded, run(tp, PROMPTS[:3], seeded), tol=1e-5)


@pytest.fixture(scope="module")
def austen_prompts(data_path) -> list[list[int]]:
    """Eight prompts of 5 to 60 tokens; every other one shares a 32-token prefix (prefix-cache hits)."""
    from rooflm.tokenizer import load_tokenizer

    ids = load_tokenizer(None)((data_path / "austen_pride_and_prejudice_ch1.txt").read_text())["input_ids"]
    prompts = []
    for i in range(8):
        n = 5 + (i * 13) % 56
        if i % 2 == 0:
            prompts.append(ids[:32] + ids[300 + i * 7: 300 + i * 7 + n])
        else:
            prompts.append(ids[100 + i * 40: 100 + i * 40 + n])
    return prompts


@pytest.mark.slow
def test_default_model_tp2_with_prefix_cache_and_chunked_prefill_equals_tp1(make_engine, austen_prompts):
    # prompt logprobs turn the prefix cache off for their request: only the last prompt asks for them
    params = [SamplingParams(max_tokens=8, temperature=0, logprobs=2)] * (len(austen_prompts) - 1)
    params.append(SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=1))
    ref = run(make_engine(quantization="none"), austen_prompts, params)
    # a 24-token budget chunks every long prompt over several steps, beside other requests' decodes
    tp = make_engine(quantization="none", tensor_parallel_size=2, max_num_batched_tokens=24,
                     enable_prefix_caching=True)
    got = run(tp, austen_prompts, params)
    assert tp.kv.prefix_hits > 0
    # chunked against whole prompts: a short chunk after a cached prefix attends token by token, a long prompt
    # through torch's fused kernel (attention/cpu_backend.py), so the two runs round differently (each within float32
    # rounding of exact attention), and 30 layers amplify it
    _assert_same(ref, got, tol=2e-5)


def test_tp2_speculative_decoding_and_preemption_equal_tp1(make_engine, tiny_checkpoint):
    """Draft tokens verified on every rank (the workers' host bookkeeping of accepted tokens included), and requests
    preempted and resumed (their generators cross again, as their state) give TP=1's tokens."""
    repeat = [[3, 4, 5, 6] * 6, [9, 8, 7] * 7]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "auto_disable": False}
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = run(make_engine(model=tiny_checkpoint, speculative_config=spec), repeat, greedy)
    tp = make_engine(model=tiny_checkpoint, speculative_config=spec, tensor_parallel_size=2)
    got = run(tp, repeat, greedy)
    assert tp.scheduler.num_draft_tokens > 0
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in ref.items()}
    tp.shutdown()  # one process group per process: the next engine makes its own

    seeded = [SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    small = dict(model=tiny_checkpoint, num_gpu_blocks_override=5, max_model_len=64)  # 80 tokens for 5 requests
    ref = run(make_engine(**small), PROMPTS, seeded)
    tp = make_engine(**small, tensor_parallel_size=2)
    got = run(tp, PROMPTS, seeded)
    assert tp.scheduler.num_preemptions > 0
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in ref.items()}
