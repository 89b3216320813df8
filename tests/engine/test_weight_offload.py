"""Weight offloading: the layers chosen, the streaming mechanism on toy layers (any order of forwards, any number of
offloaded layers), and the default model giving the same tokens with a third of its layers offloaded."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from rooflm.worker.weight_offload import WeightOffloader, choose_offloaded, materialize_with_offload


def test_offloaded_layers_cover_the_bytes_plus_the_two_slots_and_are_spread():
    assert choose_offloaded(30, 10, 0) == []
    assert choose_offloaded(30, 10, 40) == [0, 5, 10, 15, 20, 25]  # 4 layers of bytes + 2 for the slots
    assert choose_offloaded(4, 10, 10**6) == [0, 1, 2, 3]  # capped at the depth


def _toy(n: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n)])


@pytest.mark.parametrize("offloaded", [[0], [1, 3], [0, 2, 4], [0, 1, 2, 3, 4]])
def test_streamed_layers_compute_what_resident_ones_do(offloaded):
    ref = _toy(5)
    net = _toy(5)
    for i in offloaded:  # the host copies hold the weights; the device (here the CPU too) gets them streamed in
        for p in net[i].parameters():
            p.data = p.data.clone()
    off = WeightOffloader(list(net), offloaded, torch.device("cpu"))
    x = torch.randn(3, 8)
    for _ in range(3):  # steps in a row
        assert torch.equal(net(x), ref(x))
    # a partial pass (a draft of the first layers only), then full passes again: slots are re-filled as needed
    assert torch.equal(net[:2](x), ref[:2](x))
    assert torch.equal(net(x), ref(x))
    assert torch.equal(net[3:](x), ref[3:](x))
    assert torch.equal(net(x), ref(x))
    # between passes every offloaded layer's parameters show their host copies, not a slot
    slot_ptrs = {t.data_ptr() for slot in off._slots for t in slot}
    assert all(p.data_ptr() not in slot_ptrs for i in offloaded for p in net[i].parameters())
    if len(offloaded) > 2:
        assert off.copies > len(offloaded)  # more layers than slots: weights really stream every pass


def test_layers_of_different_shapes_are_refused():
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    with pytest.raises(ValueError, match="same parameter shapes"):
        WeightOffloader(list(net), [0, 1], torch.device("cpu"))


def test_materialize_keeps_tied_weights_tied():
    with torch.device("meta"):
        emb = nn.Embedding(10, 4)
        head = nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        model = nn.ModuleDict({"emb": emb, "layers": nn.ModuleList([nn.Linear(4, 4)]), "head": head})
    materialize_with_offload(model, model["layers"], [0], torch.device("cpu"))
    assert model["head"].weight is model["emb"].weight and not model["emb"].weight.is_meta
    assert not any(p.is_meta for p in model.parameters())


def test_default_model_with_offloaded_layers_gives_the_same_tokens():
    from rooflm import LLM, SamplingParams

    prompts = ["The history of the English language", "Once upon a time there was", "The history of the sea"]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(quantization="none", show_progress=False, max_num_batched_tokens=16)  # chunked prefill too
    want = [o.outputs[0].token_ids for o in LLM(None, **kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(None, cpu_offload_gb=0.05, **kw)
    off = llm.engine.model.weight_offloader
    assert len(off.indices) == 6 and off.offloaded_bytes > 0.05 * 2**30
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert off.copies > len(off.indices)


def test_offload_options_are_validated():
    from rooflm.config import EngineConfig
    from rooflm.loader import load_model

    with pytest.raises(ValueError, match="cpu_offload_gb"):
        EngineConfig(cpu_offload_gb=-1)
    with pytest.raises(ValueError, match="cpu_offload_gb=1 needs float weights"):
        load_model(None, cpu_offload_gb=1)  # a GGUF file kept quantized
