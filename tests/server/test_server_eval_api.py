"""The completions API that evaluation harnesses use, against `rooflm serve` with the embedded default model:
``echo`` with ``logprobs`` (OpenAI's legacy layout), ``max_tokens: 0``, vLLM's ``prompt_logprobs``, ``logit_bias``,
``/tokenize``, ``/detokenize`` and ``/tokenizer_info``. Log-likelihoods are compared with transformers on the same
GGUF weights (float32)."""
from __future__ import annotations


import httpx
import pytest
import torch
from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATIONS = [" Paris", " London", " a large city in Europe"]
TOLERANCE = 1e-3  # per item (sum over the continuation)


def hf_logprobs(model, ids: list[int]) -> list[float]:
    """log P(ids[p] | ids[:p]) for p >= 1."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]


def hf_argmax(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].argmax(dim=-1).tolist()


def post(server: ServerProcess, path: str, body: dict) -> dict:
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_give_the_log_likelihood_of_transformers(real_server: ServerProcess, hf):
    """What lm-eval's local-completions sends for loglikelihood requests, and how it reads the answer."""
    model, tok = hf
    ctx = tok(CONTEXT, add_special_tokens=False)["input_ids"]
    for cont in CONTINUATIONS:
        whole = tok(CONTEXT + cont, add_special_tokens=False)["input_ids"]
        assert whole[:len(ctx)] == ctx
        out = post(real_server, "/v1/completions", {"prompt": [whole], "max_tokens": 1, "logprobs": 1, "echo": True,
                                                    "temperature": 0, "seed": 1234})
        lp = out["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(whole) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        ref = hf_logprobs(model, whole)
        got = lp["token_logprobs"][1:len(whole)]
        assert max(abs(a - b) for a, b in zip(got, ref)) < TOLERANCE
        ll = sum(lp["token_logprobs"][len(ctx):-1])
        assert ll == pytest.approx(sum(ref[len(ctx) - 1:]), abs=TOLERANCE), cont
        # is_greedy as lm-eval computes it: the token's logprob is the best of top_logprobs (k=1)
        greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][len(ctx):-1],
                                                               lp["top_logprobs"][len(ctx):-1]))
        best = hf_argmax(model, whole)
        assert greedy == all(best[p - 1] == whole[p] for p in range(len(ctx), len(whole))), cont
        assert out["choices"][0]["text"].startswith(tok.decode(whole))


def test_max_tokens_zero_with_echo_scores_the_prompt_only(real_server: ServerProcess, hf):
    model, tok = hf
    ids = tok("It is a truth universally acknowledged", add_special_tokens=False)["input_ids"]
    out = post(real_server, "/v1/completions", {"prompt": "It is a truth universally acknowledged", "max_tokens": 0,
                                                "echo": True, "logprobs": 2})
    choice = out["choices"][0]
    assert choice["text"] == "It is a truth universally acknowledged"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and all(len(top) == 2 for top in lp["top_logprobs"][1:])
    assert lp["token_logprobs"][1:] == pytest.approx(hf_logprobs(model, ids), abs=TOLERANCE)
    with real_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_on_both_endpoints(real_server: ServerProcess, hf):
    model, tok = hf
    ids = tok("The three primary colours are", add_special_tokens=False)["input_ids"]
    ref = hf_logprobs(model, ids)
    out = post(real_server, "/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 3,
                                                "temperature": 0})
    pl = out["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for p in range(1, len(ids)):
        entry = pl[p]
        assert str(ids[p]) in entry and 3 <= len(entry) <= 4
        assert entry[str(ids[p])]["logprob"] == pytest.approx(ref[p - 1], abs=TOLERANCE)
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks == [1, 2, 3]
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = post(real_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    chat_ids = post(real_server, "/tokenize", {"messages": messages})["tokens"]
    assert len(chat["prompt_logprobs"]) == len(chat_ids) and chat["prompt_logprobs"][0] is None
    chat_ref = hf_logprobs(model, chat_ids)
    got = [chat["prompt_logprobs"][p][str(chat_ids[p])]["logprob"] for p in range(1, len(chat_ids))]
    assert got == pytest.approx(chat_ref, abs=TOLERANCE)


def test_logit_bias_forces_a_token(real_server: ServerProcess, hf):
    _, tok = hf
    forced = tok(" banana", add_special_tokens=False)["input_ids"][-1]
    out = post(real_server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True,
                                                "logit_bias": {str(forced): 100}, "logprobs": 0})
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == [tok.decode([forced])] * 4
    assert all(v < 0 for v in lp["token_logprobs"])  # the model's own logprobs, not the biased ones


def test_tokenizer_endpoints_as_vllm_serves_them(real_server: ServerProcess, hf):
    _, tok = hf
    text = "Hello world, tokenizers!"
    t = post(real_server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert t["tokens"] == tok(text, add_special_tokens=False)["input_ids"] and t["count"] == len(t["tokens"])
    assert t["token_strs"] == tok.convert_ids_to_tokens(t["tokens"])
    assert post(real_server, "/detokenize", {"tokens": t["tokens"]})["prompt"] == text
    with real_server.client() as c:
        info = c.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] > 0
    assert httpx.get(real_server.url + "/tokenizer_info").status_code == 401  # the API key protects it too
