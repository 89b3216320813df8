"""The native decode layers (``rooflm.models.cpu_lean_stack``: one C call per layer for a one-token step) against the
per-operator lean loop (``ROOFLM_CPU_LEAN=ops``) and the modules (``off``): the same floats, bit for bit, and the
steps they must leave to the loop."""
from __future__ import annotations

import pytest
import torch
from model_utils import load_tiny as _load
from test_cpu_lean import DECODE_STEPS, PROMPT, _assert_identical, _greedy

from rooflm.attention.metadata_utils import build_attention_metadata
from rooflm.models.cpu_lean import lean_plan
from rooflm.models.cpu_lean_stack import NativeStack


def _runs(monkeypatch, model, cfg, tables, prompts=(PROMPT,), steps=DECODE_STEPS):
    """{mode: (logits, tokens)} for ROOFLM_CPU_LEAN = on, ops, off, and how many steps the native layers computed
    under ``on``."""
    computed = []
    real = NativeStack.run

    def counting(self, *args):
        out = real(self, *args)
        computed.append(out is not None)
        return out

    monkeypatch.setattr(NativeStack, "run", counting)
    runs = {}
    for mode in ("on", "ops", "off"):
        monkeypatch.setenv("ROOFLM_CPU_LEAN", mode)
        runs[mode] = _greedy(model, cfg, tables, list(prompts), steps)
        if mode == "on":
            ran = sum(computed)
    return runs, ran


@pytest.mark.parametrize("quantization", ["w4a16", "w8a16"])
@pytest.mark.parametrize("tables", [[[0, 1, 2, 3, 4]], [[6, 2, 9, 0, 4]]], ids=["consecutive", "scattered"])
def test_native_layers_compute_the_per_operator_floats(monkeypatch, tiny_models, quantization, tables) -> None:
    model, cfg = tiny_models[quantization]
    runs, ran = _runs(monkeypatch, model, cfg, tables)
    assert ran == DECODE_STEPS  # every decode step (not the prefill) went through the native layers
    _assert_identical(runs["on"], runs["ops"])
    _assert_identical(runs["on"], runs["off"])


@pytest.mark.parametrize("quantization", ["none", "w4a16-torch"])
def test_not_built_without_native_weights(monkeypatch, tiny_models, quantization) -> None:
    """Float projections and torch's int4 kernel stay on the per-operator loop."""
    model, cfg = tiny_models[quantization]
    runs, ran = _runs(monkeypatch, model, cfg, [[0, 1, 2, 3, 4]], steps=2)
    assert ran == 0
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    assert lean_plan(model.model).stack is False
    _assert_identical(runs["on"], runs["off"])


def test_batches_and_torch_operators_are_left_to_the_loop(monkeypatch, tiny_models) -> None:
    """Two sequences in a step, and a step with the native operators switched off (``ROOFLM_CPU_NATIVE=off``: the
    loop then computes rotary, attention and norms with torch), are not taken."""
    model, cfg = tiny_models["w4a16"]
    runs, ran = _runs(monkeypatch, model, cfg, [[0, 1, 2], [5, 3, 4]], [PROMPT[:6], PROMPT[2:]], steps=3)
    assert ran == 0
    _assert_identical(runs["on"], runs["off"])
    monkeypatch.setenv("ROOFLM_CPU_NATIVE", "off")
    runs, ran = _runs(monkeypatch, model, cfg, [[0, 1, 2, 3, 4]], steps=2)
    assert ran == 0
    _assert_identical(runs["on"], runs["off"])


def test_norm_weights_replaced_between_steps_are_read(monkeypatch, tmp_path_factory) -> None:
    """The layers' arguments hold the norm weights' addresses: a weight replaced by a new tensor (not copied in
    place) must be seen at the next step, as the modules see it."""
    model, cfg = _load(tmp_path_factory, "w4a16")
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "on")
    before = _greedy(model, cfg, [[0, 1, 2, 3, 4]], [PROMPT], 3)  # the native layers built, with these weights
    stack = lean_plan(model.model).stack
    assert isinstance(stack, NativeStack)
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data = norm.weight.data * 1.5 - 0.25  # new storage
    runs, ran = _runs(monkeypatch, model, cfg, [[0, 1, 2, 3, 4]], steps=3)
    assert ran == 3
    _assert_identical(runs["on"], runs["off"])
    assert not torch.equal(runs["on"][0][1], before[0][1])  # the new weights changed the logits


def test_a_cache_of_another_size_at_the_same_address(monkeypatch, tiny_models) -> None:
    """The layers' arguments are kept between steps: caches of a new size that start where the old ones did (their
    memory reused) have their V planes elsewhere, which the next step must use."""
    model, cfg = tiny_models["w4a16"]
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    buffers = [torch.zeros(2 * 10 * 4 * hkv * d) for _ in range(cfg.num_hidden_layers)]

    def decode(blocks: int, table: list[int]) -> list[torch.Tensor]:
        caches = [b[: 2 * blocks * 4 * hkv * d].view(2, blocks, 4, hkv, d).zero_() for b in buffers]
        ids, done, new, outs = PROMPT, 0, len(PROMPT), []
        with torch.inference_mode():
            for _ in range(4):
                meta, positions = build_attention_metadata([table], [done], [new], 4)
                logits = model.compute_logits(model(torch.tensor(ids), positions, caches, meta)[-1:])
                outs.append(logits)
                ids, done, new = [int(logits.argmax())], done + new, 1
        return outs

    runs = {}
    for mode in ("on", "off"):
        monkeypatch.setenv("ROOFLM_CPU_LEAN", mode)
        decode(5, [0, 1, 2, 3, 4])  # the native layers' arguments made for five-block caches at these addresses
        runs[mode] = decode(10, [6, 2, 9, 0, 4])
    assert all(torch.equal(a, b) for a, b in zip(runs["on"], runs["off"], strict=True))


def test_a_bad_mode_is_named(monkeypatch, tiny_models) -> None:
    model, _ = tiny_models["w4a16"]
    monkeypatch.setenv("ROOFLM_CPU_LEAN", "op")
    with pytest.raises(ValueError, match="ROOFLM_CPU_LEAN='op'.*on, ops, off"):
        lean_plan(model.model)
