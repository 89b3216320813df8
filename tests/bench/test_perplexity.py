"""``rooflm bench perplexity``: the windowing scores every token once, the engine's figure equals transformers' on the
same model, text and windows (prefilled in chunks through the paged KV cache), a damaged model scores far worse,
and the command's options, table and JSON."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math

import pytest
import torch
import transformers

from rooflm.bench import perplexity as ppl
from rooflm.cli import build_parser
from rooflm.llm import LLM

WINDOW, CHUNK = 64, 16  # every window is prefilled in 4 chunks of 16


@pytest.fixture(scope="module")
def tokenizer():
    from rooflm.tokenizer import load_tokenizer

    return load_tokenizer(None)  # the embedded default model's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """A random 2-layer Llama over the default tokenizer's vocabulary, saved with that tokenizer; weights large
    enough that its next-token distributions are far from uniform."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256, initializer_range=0.5)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), model


def _llm(folder: str, window: int = WINDOW) -> LLM:
    return LLM(folder, dtype="float32", device="cpu", max_model_len=window + 1, max_num_batched_tokens=CHUNK,
               enable_prefix_caching=False, kv_cache_memory=16 * 2**20, show_progress=False)


def _hf_logprobs(model, ids: list[int], window: int, stride: int) -> list[float]:
    """Hugging Face's strided evaluation, written out: window [b, b + window) for b = 0, stride, ...; a window
    scores the tokens past the previous window's end, each given the window's tokens before it."""
    out, prev_end, begin = [], 0, 0
    while prev_end < len(ids):
        end = min(begin + window, len(ids))
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids[begin:end]])).logits[0].double(), dim=-1)
        for p in range(max(prev_end, begin + 1), end):
            out.append(lp[p - begin - 1, ids[p]].item())
        prev_end, begin = end, begin + stride
    return out


@pytest.mark.parametrize("num_tokens,window,stride", [(10, 4, 4), (11, 4, 4), (10, 4, 1), (23, 8, 3), (5, 8, 8),
                                                      (100, 64, 64), (100, 64, 40), (2, 2, 1)])
def test_windows_score_every_token_once_with_context(num_tokens, window, stride):
    windows = ppl.plan_windows(num_tokens, window, stride)
    scored = [p for w in windows for p in range(w.first_scored, w.end)]
    if stride < window:  # each token after the first, once, in order
        assert scored == list(range(1, num_tokens))
    else:  # each token but the windows' first ones
        assert scored == [p for p in range(num_tokens) if p % window != 0]
    for w in windows:
        assert 0 <= w.begin < w.first_scored < w.end <= num_tokens and w.end - w.begin <= window
        assert w.begin % stride == 0
        if stride == window:  # non-overlapping: all but the window's first token
            assert w.first_scored == w.begin + 1
        else:  # overlapping: every scored token keeps the overlap as context (once the text is that long)
            assert w.first_scored - w.begin >= min(w.first_scored, window - stride)
    if stride == window:
        assert len(scored) == num_tokens - len(windows)


@pytest.mark.parametrize("stride", [WINDOW, 40])
def test_engine_perplexity_equals_transformers(tiny, tokenizer, stride):
    folder, hf = tiny
    ids = ppl.excerpt_tokens(tokenizer, ppl.load_text(), 150)
    assert len(ids) == 150
    llm = _llm(folder)
    steps = 0
    step = llm.engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return step()

    llm.engine.step = counting_step
    result = ppl.perplexity(llm, ids, WINDOW, stride)
    ref = _hf_logprobs(hf, ids, WINDOW, stride)
    windows = ppl.plan_windows(len(ids), WINDOW, stride)
    assert steps >= sum(w.end - w.begin for w in windows) / CHUNK  # the windows went through in chunks
    assert result.num_scored == (len(ids) - 1 if stride < WINDOW else len(ids) - len(windows)) == len(ref)
    assert result.token_logprobs == pytest.approx(ref, abs=1e-4)
    expected = math.exp(-sum(ref) / len(ref))
    assert result.perplexity == pytest.approx(expected, rel=1e-3)
    assert result.mean_nll == pytest.approx(-sum(ref) / len(ref), rel=1e-4)
    spread = max(ref) - min(ref)
    assert spread > 1.0, "the model's distributions are too flat for this comparison to mean much"


def test_shuffled_weights_score_far_worse(tokenizer):
    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine
    from rooflm.loader import load_model

    model, cfg = load_model(None, dtype=torch.float32, device="cpu", show_progress=False)
    ids = ppl.excerpt_tokens(tokenizer, ppl.load_text(), 160)

    def score() -> float:
        engine = LLMEngine(EngineConfig(max_model_len=81, max_num_batched_tokens=32, kv_cache_memory=64 * 2**20,
                                        enable_prefix_caching=False, show_progress=False),
                           model=model, model_config=cfg, tokenizer=tokenizer)
        return ppl.perplexity(LLM.from_engine(engine), ids, 80).perplexity

    right = score()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            flat = param.view(-1)
            flat.copy_(flat[torch.randperm(flat.numel(), generator=g)])
    shuffled = score()
    assert right < cfg.vocab_size / 10  # far better than guessing uniformly
    assert shuffled > 10 * right


def test_command_compare_table_and_json(tiny, tokenizer, tmp_path, capsys):
    folder, _ = tiny
    out = tmp_path / "ppl.json"
    args = build_parser().parse_args(
        ["bench", "perplexity", "--model", folder, "--dtype", "float32", "--device", "cpu", "--max-tokens", "120",
         "--window", str(WINDOW), "--stride", "48", "--max-num-batched-tokens", str(CHUNK), "--compare", "none,none",
         "--json", str(out), "--csv", str(tmp_path / "ppl.csv")])
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    table = list(csv.DictReader((tmp_path / "ppl.csv").open()))  # one row per setting, the run's fields on each
    assert [r["setting"] for r in table] == ["none", "none"]
    assert [float(r["perplexity"]) for r in table] == pytest.approx([r["perplexity"] for r in res["results"]])
    assert {r["window"] for r in table} == {str(WINDOW)} and {r["stride"] for r in table} == {"48"}
    direct = ppl.perplexity(_llm(folder), ppl.excerpt_tokens(tokenizer, ppl.load_text(), 120), WINDOW, 48)
    rows = res["results"]
    assert [r["setting"] for r in rows] == ["none", "none"]
    assert [r["num_scored"] for r in rows] == [119, 119] and res["stride"] == 48
    for r in rows:  # unquantized either way: the same figure as a direct evaluation
        assert r["perplexity"] == pytest.approx(direct.perplexity, rel=1e-6)
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] == pytest.approx(1.0, rel=1e-6)
    printed = capsys.readouterr().out
    assert "perplexity" in printed and f"{rows[1]['perplexity']:.4f}" in printed


def test_command_defaults_to_embedded_model():
    args = build_parser().parse_args(["bench", "perplexity"])
    assert args.model is None and args.max_tokens == 4096 and args.window == 1024 and args.stride is None
    assert args.max_num_batched_tokens == 256 and args.quantization is None and args.kv_cache_dtype is None


@dataclasses.dataclass
class _BareConfig:  # an engine without the quantization options
    model: str | None = None


@dataclasses.dataclass
class _QuantConfig:
    model: str | None = None
    quantization: str = "none"
    kv_cache_dtype: str = "auto"


def test_options_passed_only_when_given(monkeypatch):
    import rooflm.config

    monkeypatch.setattr(rooflm.config, "EngineConfig", _QuantConfig)
    assert ppl.engine_options(None, None) == {}
    assert ppl.engine_options("w4a16", None) == {"quantization": "w4a16"}
    assert ppl.engine_options("none", "int8") == {"quantization": "none", "kv_cache_dtype": "int8"}
    monkeypatch.setattr(rooflm.config, "EngineConfig", _BareConfig)
    assert ppl.engine_options("none", "auto") == {}  # what an engine without the options does anyway
    with pytest.raises(ValueError, match="--quantization w4a16"):
        ppl.engine_options("w4a16", None)
    with pytest.raises(ValueError, match="--kv-cache-dtype int8"):
        ppl.engine_options(None, "int8")


def test_engine_rejection_names_the_flag(tiny, monkeypatch):
    """Whatever the engine says about an option (unknown, or a bad value), the error names the command's flag."""
    folder, _ = tiny
    monkeypatch.setattr(ppl, "engine_options", lambda q, kv: {"quantization": "not-a-scheme"})
    args = argparse.Namespace(model=folder, dtype="float32", device="cpu", window=WINDOW, max_tokens=100,
                              stride=None, max_num_batched_tokens=CHUNK)
    with pytest.raises(ValueError, match="^--quantization not-a-scheme: "):
        ppl._evaluate_setting(args, "some text", "not-a-scheme", None)


@pytest.mark.parametrize("call,field", [
    (lambda: ppl.plan_windows(10, 1), "window"),
    (lambda: ppl.plan_windows(10, 4, 0), "stride"),
    (lambda: ppl.plan_windows(10, 4, 5), "stride"),
    (lambda: ppl.plan_windows(1, 4), "num_tokens"),
    (lambda: ppl.parse_compare("none"), "compare"),
    (lambda: ppl.parse_compare("none,w4a16:"), "compare"),
    (lambda: ppl.excerpt_tokens(None, "text", 10), "tokenizer"),
])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


@pytest.mark.parametrize("argv,flag", [
    (["--compare", "none,w8a16", "--quantization", "w4a16"], "--compare"),
    (["--max-tokens", "1"], "--max-tokens"),
    (["--window", "8", "--stride", "9"], "stride"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
])
def test_bad_flags_fail_before_loading(argv, flag, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded for a bad command line")

    monkeypatch.setattr(ppl, "_evaluate_setting", no_load)
    args = build_parser().parse_args(["bench", "perplexity", *argv])
    with pytest.raises(ValueError, match=flag):
        args.func(args)


def test_compare_entries_take_the_kv_dtype_flag():
    assert ppl.parse_compare("none, w8a16,w4a16:fp8", "int8") == [("none", "int8"), ("w8a16", "int8"),
                                                                   ("w4a16", "fp8")]
    assert ppl.parse_compare("none,none:int8") == [("none", None), ("none", "int8")]
