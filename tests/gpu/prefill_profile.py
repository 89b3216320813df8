"""Where a long prefill's time goes, per kernel: ``python tests/gpu/prefill_profile.py --quantization fp8
[--input-len 2048]``. Loads Llama-2-7B with dummy weights, runs one warm prefill (one new token) and profiles a
second one, then prints the kernels by total CUDA time. A diagnostic for the FP8 W8A8 prefill (activation
quantization, ``torch._scaled_mm``), not a test."""
from __future__ import annotations

import argparse

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    from rooflm import LLM, SamplingParams

    llm = LLM(model="llama-2-7b", load_format="dummy", dtype="float16", quantization=a.quantization,
              max_model_len=a.input_len + 8, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, a.input_len))
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = [[int(t) for t in torch.randint(100, 30000, (a.input_len,))]]
    llm.generate(prompt, sp, use_tqdm=False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, sp, use_tqdm=False)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
