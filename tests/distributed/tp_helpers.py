"""Helpers shared by the tensor-parallel tests."""
from __future__ import annotations

from rooflm.engine.engine import LLMEngine

# A Llama that splits unevenly over two ranks everywhere: one KV head (replicated), a vocabulary of 131 rows, and
# every bias (q/k/v, o_proj, MLP).
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 131, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "attention_bias": True, "mlp_bias": True}


def run(engine: LLMEngine, prompts: list[list[int]], params) -> dict[str, object]:
    """Every request to completion; request id -> its final RequestOutput."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done
