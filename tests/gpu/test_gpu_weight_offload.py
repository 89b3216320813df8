"""Weight offloading on the GPU: layers streamed from pinned host memory on a side stream give the tokens of the
all-resident model (greedy, a batch with chunked prefill). Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tokens(cpu_offload_gb: float):
    from rooflm import LLM, SamplingParams

    llm = LLM("smollm2-135m", load_format="dummy", dtype="float16", max_num_seqs=8, kv_cache_memory=256 * 2**20,
              max_model_len=512, max_num_batched_tokens=64, cpu_offload_gb=cpu_offload_gb, show_progress=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 77, 140, 33)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], getattr(llm.engine.model, "weight_offloader", None)


def test_offloaded_layers_give_the_resident_tokens_on_the_gpu():
    want, _ = _tokens(0)
    got, off = _tokens(0.05)
    assert off is not None and len(off.indices) >= 3
    assert all(t.is_pinned() for t in off._host[0]), "the host copies are not page-locked"
    assert got == want
    assert off.copies > len(off.indices)
