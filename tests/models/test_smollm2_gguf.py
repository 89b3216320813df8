"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): rooflm against transformers loading the same file."""
from __future__ import annotations

import math
import os

import pytest
import torch

from model_utils import PagedRunner, assert_close_rel, hf_model_from_gguf
from rooflm.loader import load_model
from rooflm.tokenizer import load_tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In the beginning God created the heaven and the earth.",
]
PPL_TOKENS = 1024


@pytest.fixture(scope="module")
def ours(default_model_path):
    """The weights dequantized at load (what transformers does with a GGUF file): the model code is compared."""
    return load_model(None, quantization="none", show_progress=False)


@pytest.fixture(scope="module")
def kept(default_model_path):
    """The default: the GGUF blocks kept quantized, multiplied by the CPU path's integer kernels."""
    return load_model(None, show_progress=False)


@pytest.fixture(scope="module")
def hf(default_model_path):
    return hf_model_from_gguf(default_model_path)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path):
    from transformers import AutoTokenizer

    folder, name = os.path.split(default_model_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return load_tokenizer(None)


def test_config_from_gguf(ours) -> None:
    _, cfg = ours
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    assert cfg.eos_token_id[0] == 2  # <|im_end|> from the metadata first


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(ours, hf, tokenizer, prompt: str) -> None:
    model, cfg = ours
    ids = tokenizer(prompt).input_ids
    mine = PagedRunner(model, cfg, len(ids), block_size=16).step(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert_close_rel(mine, theirs, rel=1e-4)


def test_kept_quantized_model_reads_fewer_bytes_and_agrees_with_dequantized(ours, kept, tokenizer) -> None:
    """Same weights, one kept in its blocks: the logits agree within the rounding of the CPU kernels' activations
    (int8 per block of 32 on the native kernel, as llama.cpp; bfloat16 on torch's), the greedy continuation is the
    same, and the projections read a quarter of the float bytes."""
    from rooflm.quantization.apply import projection_weight_bytes

    (model, cfg), (qmodel, _) = ours, kept
    ids = tokenizer(PROMPTS[0]).input_ids
    ref = PagedRunner(model, cfg, len(ids), block_size=16).step(ids)
    out = PagedRunner(qmodel, cfg, len(ids), block_size=16).step(ids)
    assert qmodel.lm_head.quantized and qmodel.model.layers[0].self_attn.qkv_proj.quantized
    rel = ((out - ref).norm() / ref.norm()).item()
    # 8-bit (native kernel) or bfloat16 activations through 30 layers: a few percent, never more
    assert 1e-6 < rel < 6e-2, rel
    assert torch.equal(out[-1].topk(3).indices, ref[-1].topk(3).indices)
    assert projection_weight_bytes(qmodel)[0] < 0.25 * projection_weight_bytes(model)[0]


def test_greedy_decode_through_cache_matches_transformers(ours, hf, tokenizer) -> None:
    model, cfg = ours
    ids = tokenizer(PROMPTS[0]).input_ids
    runner = PagedRunner(model, cfg, len(ids) + 12, block_size=16)
    mine, logits = [], runner.step(ids)[-1]
    for _ in range(12):
        mine.append(int(logits.argmax()))
        logits = runner.step([mine[-1]])[-1]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert mine == out[0, len(ids):].tolist()


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_lean_cpu_loop_decodes_the_same_tokens(kept, tokenizer, monkeypatch, prompt: str) -> None:
    """The default model kept quantized, greedy through the cache: the CPU path's lean loop
    (``rooflm.models.cpu_lean``) and the module-by-module forward give the same tokens and the same logits, bit for
    bit."""
    model, cfg = kept
    ids = tokenizer(prompt).input_ids
    runs = {}
    for flag in ("on", "off"):
        monkeypatch.setenv("ROOFLM_CPU_LEAN", flag)
        runner = PagedRunner(model, cfg, len(ids) + 16, block_size=16)
        logits = runner.step(ids)[-1]
        tokens, steps = [], [logits]
        for _ in range(16):
            tokens.append(int(logits.argmax()))
            logits = runner.step([tokens[-1]])[-1]
            steps.append(logits)
        runs[flag] = tokens, steps
    assert runs["on"][0] == runs["off"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["on"][1], runs["off"][1], strict=True))


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]))
    return math.exp(nll.item())


@pytest.mark.slow
def test_perplexity_of_austen_passage(ours, hf, tokenizer, data_dir) -> None:
    model, cfg = ours
    text = (data_dir / "austen_pride_and_prejudice_ch1.txt").read_text()
    ids = tokenizer(text).input_ids[:PPL_TOKENS]
    assert len(ids) == PPL_TOKENS
    mine = _perplexity(PagedRunner(model, cfg, len(ids), block_size=16).step(ids), ids)
    with torch.no_grad():
        theirs = _perplexity(hf(torch.tensor([ids])).logits[0], ids)
    assert 1.0 < mine < 100.0  # a sane model on English prose
    assert abs(mine - theirs) / theirs < 0.005, (mine, theirs)


TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "naïve café — 東京 🚀", "<|im_start|>user\nhi"]


def test_tokenizer_matches_transformers(tokenizer, hf_tokenizer) -> None:
    for text in TEXTS:
        assert tokenizer(text).input_ids == hf_tokenizer(text).input_ids
        assert tokenizer.decode(tokenizer(text).input_ids) == hf_tokenizer.decode(hf_tokenizer(text).input_ids)
    assert tokenizer.eos_token == hf_tokenizer.eos_token


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, default_model_path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3?"}]
    for msgs in (messages, messages[1:2]):
        ours = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        theirs = hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert ours == theirs and ours.endswith("<|im_start|>assistant\n")
    from rooflm.loader.gguf import open_gguf

    assert tokenizer.chat_template == open_gguf(default_model_path).fields["tokenizer.chat_template"].contents()
