"""lm-evaluation-harness (``local-completions``, unchanged) against `rooflm serve`: a multiple-choice task from a
local JSONL file and a rolling log-likelihood task; every per-item log-likelihood equals transformers' on the same
GGUF weights (float32) within 1e-3. Skipped when lm-eval is not installed."""
from __future__ import annotations

import json

import pytest
import torch
from server_helpers import API_KEY, ServerProcess

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]')")

TOLERANCE = 1e-3
MAX_LENGTH = 48  # small, so the rolling task needs several windows
MC = [{"question": "What is the capital of France?", "choices": ["Paris", "London", "Berlin"], "answer": 0},
      {"question": "Which animal says moo?", "choices": ["a cat", "a cow"], "answer": 1}]
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families.")


def _tasks(folder) -> None:
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (folder / "rolling.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    (folder / "mc.yaml").write_text(
        "task: rooflm_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_target: \"{{answer}}\"\n"
        "doc_to_choice: \"{{choices}}\"\nmetric_list:\n  - metric: acc\n")
    (folder / "rolling.yaml").write_text(
        "task: rooflm_rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'rolling.jsonl'}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        "doc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\nmetric_list:\n  - metric: word_perplexity\n"
        "    aggregation: weighted_perplexity\n    higher_is_better: false\n")


def _loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(lp[len(context) + j - 1, t].item() for j, t in enumerate(continuation))


def test_lm_eval_local_completions_matches_transformers(real_server: ServerProcess, hf, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    _tasks(tmp_path)
    model, tok = hf
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": real_server.url + "/v1/completions", "tokenizer_backend": "remote",
                    "auth_token": API_KEY, "header": {"Authorization": f"Bearer {API_KEY}"},
                    "max_length": MAX_LENGTH, "num_concurrent": 1, "max_retries": 1},
        tasks=["rooflm_mc", "rooflm_rolling"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, batch_size=1)

    def encode(text: str) -> list[int]:  # what the harness's remote tokenizer gets from /tokenize
        return tok(text, add_special_tokens=False)["input_ids"]

    mc = results["samples"]["rooflm_mc"]
    assert len(mc) == len(MC)
    for sample in mc:
        assert len(sample["arguments"]) == len(sample["resps"]) >= 2
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            whole, ctx = encode(context + continuation), encode(context)
            expected = _loglikelihood(model, ctx, whole[len(ctx):])
            assert resp[0][0] == pytest.approx(expected, abs=TOLERANCE), (context, continuation)

    (rolling,) = results["samples"]["rooflm_rolling"]
    # the harness's prefix for the first window: BOS when the tokenizer has one, else EOS
    eot = tok(tok.bos_token or tok.eos_token, add_special_tokens=False)["input_ids"][0]
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
        token_list=encode(TEXT), prefix_token=eot, max_seq_len=MAX_LENGTH - 2, context_len=1)]
    assert len(windows) >= 2  # the text spans several windows
    expected = sum(_loglikelihood(model, list(ctx), list(cont)) for ctx, cont in windows)
    assert rolling["resps"][0][0] == pytest.approx(expected, abs=TOLERANCE)
    assert results["results"]["rooflm_mc"]["acc,none"] == 1.0
