"""StreamingLLM through the engine equals transformers (the oracle) given the same attention pattern.

A tiny random Llama checkpoint scores a prompt through the engine with KV compression (prompt logprobs, prefilled
in chunks). The oracle is the Hugging Face model run once over the whole prompt with a custom 4D attention mask:
query p may see exactly the keys the block-granular rule keeps when p's chunk is computed (the sink blocks, the
window blocks not dropped yet, and the chunk's tokens up to p), at their original positions (the variant rooflm
implements, keys cached after rotary embedding)."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from rooflm.config import EngineConfig
from rooflm.engine.engine import LLMEngine
from rooflm.kv_cache.compression import KVCompressionConfig, plan_drop
from rooflm.sampling_params import SamplingParams

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.08)
LENGTH = 60


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    hf.save_pretrained(folder)
    ids = torch.randint(0, TINY["vocab_size"], (LENGTH,), generator=torch.Generator().manual_seed(1)).tolist()
    return str(folder), hf, ids


def streaming_mask(cfg: KVCompressionConfig, length: int, block_size: int, chunk: int) -> torch.Tensor:
    """[length, length] bool: the keys each query sees when the prompt is computed ``chunk`` tokens a step."""
    mask = torch.zeros(length, length, dtype=torch.bool)
    kept: list[int] = []
    sink = cfg.sink_blocks(block_size) * block_size
    p = 0
    while p < length:
        m = min(chunk, cfg.max_new_tokens(block_size), length - p)
        n = plan_drop(cfg, len(kept), m, block_size)
        del kept[sink:sink + n * block_size]
        for q in range(p, p + m):
            kept.append(q)
            mask[q, kept] = True
        p += m
    return mask


@pytest.mark.parametrize("block_size,budget,chunk", [(4, 20, 1), (4, 24, 7), (1, 9, 3)])
def test_streaming_equals_the_masked_oracle(checkpoint, block_size, budget, chunk):
    folder, hf, ids = checkpoint
    comp = {"method": "streaming", "budget": budget, "sink": 4}
    engine = LLMEngine(EngineConfig(model=folder, dtype="float32", device="cpu", block_size=block_size,
                                    max_num_batched_tokens=chunk, kv_cache_memory=2**20, kv_compression=comp,
                                    enable_prefix_caching=False, show_progress=False))
    (out,) = [o for o in _drain(engine, ids) if o.finished]
    mask = streaming_mask(KVCompressionConfig(**comp), LENGTH, block_size, chunk)
    assert not mask.tril().all(), "nothing was dropped"
    bias = torch.zeros(1, 1, LENGTH, LENGTH).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), attention_mask=bias,
                 position_ids=torch.arange(LENGTH)[None]).logits[0].log_softmax(-1)
        full = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    got = [out.prompt_logprobs[p][ids[p]] for p in range(1, LENGTH)]
    want = [ref[p - 1, ids[p]].item() for p in range(1, LENGTH)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    # and the mask mattered: full attention gives other log-probabilities
    assert max(abs(a - full[p - 1, ids[p]].item()) for p, a in zip(range(1, LENGTH), got)) > 1e-2
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(math.isfinite(x) for x in got)


def _drain(engine: LLMEngine, ids: list[int]):
    engine.add_request("r", ids, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
    while engine.has_unfinished_requests():
        yield from engine.step()
