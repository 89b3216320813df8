"""``rooflm bench perplexity --kv-budgets``: one row per StreamingLLM budget, 0 being full attention; a budget that
holds the whole window scores exactly as full attention, a smaller one differently."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from rooflm.bench import perplexity as ppl
from rooflm.cli import build_parser


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rooflm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    folder = tmp_path_factory.mktemp("tiny-llama-ppl")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256, initializer_range=0.5)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_kv_budgets_rows(tiny, tmp_path):
    out = tmp_path / "ppl.json"
    args = build_parser().parse_args(
        ["bench", "perplexity", "--model", tiny, "--dtype", "float32", "--device", "cpu", "--max-tokens", "100",
         "--window", "100", "--max-num-batched-tokens", "8", "--kv-budgets", "0,48,128", "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["kv_budget"] for r in rows] == [0, 48, 128]
    assert [r["setting"] for r in rows] == ["default full attention", "default streaming:48",
                                            "default streaming:128"]
    full, small, whole = (r["perplexity"] for r in rows)
    assert whole == pytest.approx(full, rel=1e-9)  # 128 tokens hold the whole 100-token window
    assert small != pytest.approx(full, rel=1e-6)


@pytest.mark.parametrize("spec", ["a,256", "-1", ""])
def test_bad_budgets_name_the_flag(spec):
    with pytest.raises(ValueError, match="--kv-budgets"):
        ppl.parse_budgets(spec)


def test_kv_methods_rows(tiny, tmp_path):
    out = tmp_path / "ppl.json"
    args = build_parser().parse_args(
        ["bench", "perplexity", "--model", tiny, "--dtype", "float32", "--device", "cpu", "--max-tokens", "100",
         "--window", "100", "--max-num-batched-tokens", "8", "--kv-budgets", "0,64,128", "--kv-methods",
         "streaming,h2o", "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["kv_budget"], r["kv_method"]) for r in rows] == [(0, None), (64, "streaming"), (64, "h2o"),
                                                                 (128, "streaming"), (128, "h2o")]
    assert rows[2]["setting"] == "default h2o:64"
    full = rows[0]["perplexity"]
    for r in rows[3:]:  # 128 tokens hold the whole 100-token window: nothing is dropped
        assert r["perplexity"] == pytest.approx(full, rel=1e-9)
    for r in rows[1:3]:
        assert r["perplexity"] != pytest.approx(full, rel=1e-6)


@pytest.mark.parametrize("spec", ["streaming,h3o", ""])
def test_bad_methods_name_the_flag(spec):
    with pytest.raises(ValueError, match="--kv-methods"):
        ppl.parse_methods(spec)
