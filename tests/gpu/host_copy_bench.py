"""Host <-> device KV copy paths on the GPU, and where the prefix cache's host tier spends its time.

``python tests/gpu/host_copy_bench.py [copies] [multiturn]``

copies: Llama-2-7B KV shapes (32 layers, [2, n, 16, 32, 128] float16), n blocks out to a pinned host pool and back:
  dma-runs (HostSwapSpace: one DMA copy per run of consecutive host ids, per layer and K/V) with consecutive and with
  scattered host ids, and uva (one gather/scatter kernel per layer reading or writing the pinned pool through its
  device address). GB/s each way.
multiturn: the multi-turn trace of ``bench multiturn`` (16 users x 6 turns, a quarter-sized pool, host tier holding the
  working set) with every host-tier copy timed (synchronised), its blocks and runs counted.
"""
from __future__ import annotations

import sys
import time

import torch


def _gbps(nbytes: float, s: float) -> float:
    return nbytes / s / 1e9


def copies() -> None:
    from rooflm.worker.swap_space import HostSwapSpace, cuda_view_of_pinned

    dev = torch.device("cuda")
    L, pool = 32, 2048
    caches = [torch.randn(2, pool, 16, 32, 128, device=dev, dtype=torch.float16) for _ in range(L)]
    for n in (8, 64, 512):
        per = 2 * n * 16 * 32 * 128 * 2 * L
        for name, host_ids in (("consecutive", list(range(n))), ("scattered", list(range(0, 2 * n, 2)))):
            space = HostSwapSpace(2 * n + 1, 16, 32, 128, L, torch.float16, "auto", dev)
            dev_ids = list(range(100, 100 + n))
            for mode in ("dma-runs", "uva"):
                space.mode = mode
                ts = []
                for _ in range(4):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    space.run(caches, list(zip(dev_ids, host_ids)), [])
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    space.run(caches, [], list(zip(host_ids, dev_ids)))
                    torch.cuda.synchronize()
                    ts.append((t1 - t0, time.perf_counter() - t1))
                out, inn = min(t for t, _ in ts[1:]), min(t for _, t in ts[1:])
                print(f"n={n:4d} {name:11s} {mode:8s} out {1e3 * out:7.2f} ms {_gbps(per, out):5.1f} GB/s   "
                      f"in {1e3 * inn:7.2f} ms {_gbps(per, inn):5.1f} GB/s", flush=True)
    host = torch.empty(2**28, dtype=torch.uint8, pin_memory=True)
    view = cuda_view_of_pinned(host)
    assert view.device.type == "cuda" and view.data_ptr() == host.data_ptr()


def multiturn() -> None:
    from rooflm.bench.multiturn import make_conversations, pool_blocks, run_trace
    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine
    from rooflm.sampling_params import SamplingParams
    from rooflm.worker import swap_space
    from rooflm.worker.swap_space import host_runs

    log: list[tuple[int, int, int, float]] = []
    plain_run = swap_space.HostSwapSpace.run

    def timed(self, kv_caches, out, inn):
        if not out and not inn:
            return
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plain_run(self, kv_caches, out, inn)
        torch.cuda.synchronize()
        runs = len(host_runs([h for _, h in out])) + len(host_runs([h for h, _ in inn]))
        log.append((len(out), len(inn), runs, time.perf_counter() - t0))

    U, T, I, O = 16, 6, 256, 64
    blocks = pool_blocks(U, T, I, O, 16, 0.25)
    conv = make_conversations(U, T, I, 32000, 0)
    for mode in ("dma-runs", "uva"):
        swap_space.HostSwapSpace.run = timed
        swap_space.DEFAULT_COPY_MODE = mode
        cfg = EngineConfig(model="llama-2-7b", load_format="dummy", dtype="float16", num_gpu_blocks_override=blocks,
                           max_model_len=T * (I + O), max_num_batched_tokens=2048, kv_offload_gb=16.0,
                           show_progress=False)
        engine = LLMEngine(cfg)
        engine.add_request("w", conv[0][0][:8], SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
        log.clear()
        r = run_trace(engine, conv, O, 2)
        per_block = 2 * 16 * 32 * 128 * 2 * 32
        n_out = sum(x[0] for x in log)
        n_in = sum(x[1] for x in log)
        t = sum(x[3] for x in log)
        print(f"{mode}: mean TTFT {1e3 * sum(r.ttft_s) / len(r.ttft_s):.1f} ms, wall {r.elapsed_s:.2f} s; host-tier "
              f"copies: {len(log)} calls, {n_out} blocks out, {n_in} in, {sum(x[2] for x in log)} runs, "
              f"{1e3 * t:.0f} ms in all = {_gbps((n_out + n_in) * per_block, t):.1f} GB/s", flush=True)
        swap_space.HostSwapSpace.run = plain_run
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    for part in sys.argv[1:] or ["copies", "multiturn"]:
        {"copies": copies, "multiturn": multiturn}[part]()
