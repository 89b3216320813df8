"""A tiny transformers model written as GGUF the way llama.cpp's converter does (llama.cpp tensor names, q/k rows
permuted for the ``llama`` architecture, not for ``qwen2``) loads in rooflm with the same logits: this checks
``read_gguf_config``, the name mapping and the un-permutation independently of transformers' GGUF reader."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from model_utils import PagedRunner, assert_close_rel
from rooflm.loader import load_model
from test_hf_parity import make_checkpoint, prompt

GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: HF's rotate-half rows -> interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf, arch: str, path: str) -> None:
    c = hf.config
    w = GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    if c.rope_parameters.get("rope_type") == "llama3":  # llama.cpp stores per-frequency divisors, not the recipe
        from rooflm.layers.rotary import base_inv_freq, llama3_inv_freq

        base = base_inv_freq(c.head_dim, c.rope_parameters["rope_theta"])
        w.add_tensor("rope_freqs.weight", (base / llama3_inv_freq(base, c.rope_parameters)).numpy())
    for name, t in hf.state_dict().items():
        a = t.float().numpy().copy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                a = llama_cpp_permute(a, c.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                a = llama_cpp_permute(a, c.num_key_value_heads)
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case,arch", [("llama-gqa", "llama"), ("llama-mha-tied", "llama"), ("llama3-rope", "llama"),
                                       ("qwen2-bias", "qwen2")])
def test_tiny_gguf_matches_transformers(tmp_path, case: str, arch: str) -> None:
    hf = make_checkpoint(case, tmp_path / "hf")
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf, arch, path)
    model, cfg = load_model(path, show_progress=False)
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.num_key_value_heads == hf.config.num_key_value_heads
    if case == "llama3-rope":
        assert cfg.rope_scaling["rope_type"] == "freq_factors"
    ids = prompt()
    with torch.no_grad():
        assert_close_rel(PagedRunner(model, cfg, len(ids)).step(ids), hf(torch.tensor([ids])).logits[0])
