"""End-to-end generation on SmolLM2-135M-Instruct (GGUF): parity with transformers, chat template, sampling,
stop conditions, logprobs, streaming and bad input."""
from __future__ import annotations

import os

import pytest
import torch

from engine_utils import run, tokens
from rooflm.llm import LLM
from rooflm.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
]


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


def test_greedy_equals_transformers(make_engine, smol, hf_model):
    tok = smol[2]
    engine = make_engine()
    n_new = 16
    ours = tokens(run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=n_new, min_tokens=n_new)))
    for prompt, got in zip(PROMPTS, ours):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():  # min_new_tokens masks EOS as our min_tokens does
            ref = hf_model.generate(ids, do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new)
        assert got == ref[0, ids.shape[1]:].tolist(), prompt


def test_prompt_logprobs_equal_transformers(make_engine, smol, hf_model):
    tok = smol[2]
    ids = tok("It is a truth universally acknowledged, that a single man")["input_ids"]
    engine = make_engine()
    out = run(engine, [ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for p in range(1, len(ids)):
        d = out.prompt_logprobs[p]
        assert ids[p] in d and len(d) <= 3
        assert d[ids[p]] == pytest.approx(ref[p - 1, ids[p]].item(), abs=2e-3)
        top = ref[p - 1].topk(2).indices.tolist()
        assert set(top) <= set(d)


def test_chat_applies_template_like_transformers(make_engine, smol):
    tok = smol[2]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    llm = LLM.from_engine(make_engine())
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)
    assert out.outputs[0].text


def test_seeded_sampling_independent_of_batch(make_engine):
    engine = make_engine()
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tokens(run(engine, [PROMPTS[2]], p))[0]
    busy = [SamplingParams(temperature=1.0, max_tokens=12 + i, ignore_eos=True) for i in range(6)]
    batch = run(engine, PROMPTS + [PROMPTS[2]] + PROMPTS[:2], busy[:4] + [p] + busy[4:])
    assert batch[4].outputs[0].token_ids == alone
    other_seed = tokens(run(engine, [PROMPTS[2]], p.clone(seed=99)))[0]
    assert other_seed != alone


def test_top_k_1_equals_greedy(make_engine):
    engine = make_engine()
    greedy = tokens(run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    topk1 = tokens(run(engine, PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True)))
    assert topk1 == greedy


def test_stop_conditions(make_engine):
    engine = make_engine()
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = run(engine, [PROMPTS[2]], base)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 24
    # A stop string taken from the middle of the greedy text ends it there, the stop string left out.
    word = full.text.split()[3]
    cut = run(engine, [PROMPTS[2]], base.clone(stop=[word]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == full.text[: full.text.index(word)]
    kept = run(engine, [PROMPTS[2]], base.clone(stop=[word], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[: full.text.index(word) + len(word)]
    # A stop token id: the sequence ends on it.
    stop_id = full.token_ids[5]
    by_id = run(engine, [PROMPTS[2]], base.clone(stop_token_ids=[stop_id]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    # min_tokens: the stop token cannot end it before then.
    late = run(engine, [PROMPTS[2]], base.clone(stop_token_ids=[stop_id], min_tokens=10))[0].outputs[0]
    assert len(late.token_ids) >= 10


def test_eos_stops_unless_ignored(make_engine):
    engine = make_engine()
    llm = LLM.from_engine(engine)
    msgs = [{"role": "user", "content": "Say hello."}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine.eos_token_ids
    assert "<|im_end|>" not in out.text
    ignored = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 3, ignore_eos=True))
    assert ignored[0].outputs[0].finish_reason == "length"


def test_logprobs_equal_transformers(make_engine, smol, hf_model):
    """Each position reports the sampled token's logprob and the top-k of the raw model distribution (before
    temperature), as vLLM does: both equal transformers' log-softmax over the same tokens."""
    tok = smol[2]
    k = 3
    prompt_ids = tok(PROMPTS[0])["input_ids"]
    engine = make_engine()
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=k, ignore_eos=True)
    c = run(engine, [prompt_ids], params)[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + c.token_ids[:-1]])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1:]  # row j: the distribution of generated token j
    total = 0.0
    for j, (tok_id, d) in enumerate(zip(c.token_ids, c.logprobs)):
        assert tok_id in d
        for t, v in d.items():
            assert v == pytest.approx(ref[j, t].item(), abs=2e-3), (j, t)
        ref_top = ref[j].topk(k).values.tolist()
        best = sorted(d.values(), reverse=True)[:k]  # the top-k, whether or not the sampled token is among them
        assert best == pytest.approx(ref_top, abs=2e-3)
        assert len(d) == k or (len(d) == k + 1 and d[tok_id] < min(best) + 2e-3)
        total += d[tok_id]
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_streaming_outputs_grow_to_final(make_engine):
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    final = run(engine, ["Héllo wörld — ünïcode ✓ 日本語のテキスト"], params)[0].outputs[0]
    engine.add_request("s", "Héllo wörld — ünïcode ✓ 日本語のテキスト", params)
    texts = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            texts.append(o.outputs[0].text)
    assert len(texts) == 20
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == final.text
    assert "\ufffd" not in "".join(texts[:-1])


def test_abort_frees_blocks(make_engine):
    engine = make_engine()
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert all(o.request_id == "b" for o in outs)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
     ({"max_tokens": 0}, "max_tokens"), ({"top_k": -3}, "top_k"), ({"logprobs": 50}, "logprobs")],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(e.value)


def test_bad_requests_rejected_engine_keeps_serving(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.add_request("long", list(range(1, 100)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", "", SamplingParams())
    with pytest.raises(ValueError, match="out of the vocabulary"):
        engine.add_request("oov", [1, 10**7], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("bad", {"text": "x"}, SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("bad", "x", {"temperature": 0})  # type: ignore[arg-type]
    out = run(engine, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    llm = LLM.from_engine(engine)
    with pytest.raises(ValueError, match="max_model_len"):  # a bad prompt in a batch: nothing queued
        llm.generate([PROMPTS[0], list(range(1, 100))], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


def test_prompt_larger_than_pool_rejected(make_engine):
    engine = make_engine(num_gpu_blocks_override=4)  # 4 blocks of 16: max_model_len is cut to the pool's 64 tokens
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="KV pool of 64 tokens"):
        engine.add_request("big", list(range(1, 70)), SamplingParams())
    with pytest.raises(ValueError, match="max_model_len=128 does not fit the KV pool"):
        make_engine(num_gpu_blocks_override=4, max_model_len=128)


def test_engine_config_errors_name_field():
    from rooflm.config import EngineConfig

    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="onnx")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="unknown option"):
        LLM(model=None, temprature=0.5)


def test_repetition_penalty_equals_transformers(make_engine, smol, hf_model):
    """The penalty reads the prompt and the tokens generated so far, as transformers' greedy search does."""
    tok = smol[2]
    engine = make_engine()
    prompt = "one two three one two three one two three one"
    n_new = 12
    got = tokens(run(engine, [prompt], SamplingParams(temperature=0, max_tokens=n_new, min_tokens=n_new,
                                                      repetition_penalty=1.5)))[0]
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        ref = hf_model.generate(ids, do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                                repetition_penalty=1.5)
    assert got == ref[0, ids.shape[1]:].tolist()
    plain = tokens(run(engine, [prompt], SamplingParams(temperature=0, max_tokens=n_new, min_tokens=n_new)))[0]
    assert plain != got  # the penalty changed something
