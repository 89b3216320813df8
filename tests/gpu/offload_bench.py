"""Weight offloading throughput against its bound, in one run: ``python tests/gpu/offload_bench.py MODEL GIB BATCH``.

Measures the pinned host-to-device copy bandwidth, then decodes BATCH sequences with GIB of the decoder weights
offloaded (dummy weights) and prints decode tokens/s beside the transfer bound: every decode step must copy the
offloaded bytes once, so tokens/s <= BATCH * bandwidth / offloaded bytes."""
from __future__ import annotations

import json
import sys
import time

import torch


def h2d_bandwidth(nbytes: int = 2**30, reps: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t)


def main(model: str, gib: float, batch: int, input_len: int = 128, output_len: int = 32) -> None:
    from rooflm import LLM, SamplingParams

    bw = h2d_bandwidth()
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", dtype="float16", cpu_offload_gb=gib, max_num_seqs=batch,
              max_model_len=input_len + output_len + 16, max_num_batched_tokens=max(2048, input_len),
              show_progress=False, enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    off = llm.engine.model.weight_offloader
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, llm.engine.model_config.vocab_size, (input_len,), generator=g).tolist()
               for _ in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    prefill = SamplingParams(max_tokens=1, ignore_eos=True)
    full = SamplingParams(max_tokens=output_len, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, prefill, use_tqdm=False)
    t_prefill = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts, full, use_tqdm=False)
    t_full = time.perf_counter() - t
    decode_s = max(t_full - t_prefill, 1e-9)
    tok_s = batch * (output_len - 1) / decode_s
    bound = batch * bw / off.offloaded_bytes
    print(json.dumps({
        "model": model, "batch": batch, "input_len": input_len, "output_len": output_len,
        "offloaded_layers": len(off.indices), "offloaded_gib": round(off.offloaded_bytes / 2**30, 2),
        "resident_gib": round(torch.cuda.memory_allocated() / 2**30, 2), "h2d_gb_s": round(bw / 1e9, 1),
        "load_s": round(load_s, 1), "decode_tok_s": round(tok_s, 1), "transfer_bound_tok_s": round(bound, 1),
        "fraction_of_bound": round(tok_s / bound, 3), "device": torch.cuda.get_device_name(),
    }))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
