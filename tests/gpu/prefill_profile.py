"""Where a long prefill's time goes, per kernel: ``python tests/gpu/prefill_profile.py --quantization fp8
[--input-len 2048] [--no-profile --reps 15]``. Loads Llama-2-7B with dummy weights, runs one warm prefill (one new
token) and profiles a second one, then prints the kernels by total CUDA time, the GPU's idle gaps with the host
operators inside them, and the wall time of the whole one-token generate call. A diagnostic for the FP8 W8A8 prefill
(activation quantization, ``torch._scaled_mm``), not a test."""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--no-profile", action="store_true", help="only the wall times")
    p.add_argument("--reps", type=int, default=5, help="timed one-token generate calls")
    a = p.parse_args()
    from rooflm import LLM, SamplingParams

    llm = LLM(model="llama-2-7b", load_format="dummy", dtype="float16", quantization=a.quantization,
              max_model_len=a.input_len + 8, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, a.input_len))
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = [[int(t) for t in torch.randint(100, 30000, (a.input_len,))]]
    llm.generate(prompt, sp, use_tqdm=False)
    torch.cuda.synchronize()
    if not a.no_profile:
        acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts) as prof:
            llm.generate(prompt, sp, use_tqdm=False)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70))
        _gaps(prof)
    walls = []
    for _ in range(a.reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
    print(f"generate (one token) wall: median {sorted(walls)[len(walls) // 2] * 1e3:.2f} ms, "
          f"min {min(walls) * 1e3:.2f} ms over {len(walls)}")


def _gaps(prof, top: int = 12) -> None:
    """The GPU's idle time between the first and the last kernel of the profiled step, and its longest gaps with the
    host operators that started inside each (a gap the host fills with work before the next launch, or a wait)."""
    from torch.autograd import DeviceType

    evs = prof.events()
    gpu = sorted((e for e in evs if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    cpu = sorted((e for e in evs if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start)
    if not gpu:
        return
    busy_end, gaps, busy = gpu[0].time_range.start, [], 0.0
    for e in gpu:
        if e.time_range.start > busy_end:
            gaps.append((e.time_range.start - busy_end, busy_end, e.name))
        busy += max(0.0, e.time_range.end - max(e.time_range.start, busy_end))
        busy_end = max(busy_end, e.time_range.end)
    span = busy_end - gpu[0].time_range.start
    print(f"GPU span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms in "
          f"{len(gaps)} gaps; host from first op to last: "
          f"{(cpu[-1].time_range.end - cpu[0].time_range.start) / 1e3:.2f} ms")
    for length, start, nxt in sorted(gaps, reverse=True)[:top]:
        inside = [c.name for c in cpu if start <= c.time_range.start < start + length][:6]
        print(f"  gap {length:8.1f} us before {nxt[:40]!r}: host ops {inside}")


if __name__ == "__main__":
    main()
