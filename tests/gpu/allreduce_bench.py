"""All-reduce latency on the GPUs of one machine: NCCL against the one-shot path (rooflm.distributed.small_collectives),
each launched eagerly and replayed from a CUDA graph, for the sizes of tensor-parallel decode steps.

    torchrun --nproc-per-node 2 tests/gpu/allreduce_bench.py [--json FILE]

Also checks the one-shot results against NCCL's (equal bit for bit at two ranks: each output is one rounding of
the same two-term sum) and the zero-padded gather against NCCL's all-gather."""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def _time(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def _graph_time(fn, per_graph: int, replays: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(per_graph):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    return _time(g.replay, replays) / per_graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", default="8,10,64,256,1024,4096", help="all-reduce sizes in KiB, comma-separated")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    from rooflm.distributed.small_collectives import OneShotAllReduce, gather_by_sum

    impls = {}
    for impl in ("torch", "triton", "lamport"):
        os.environ["ROOFLM_TP_ALLREDUCE"] = impl
        impls[impl] = OneShotAllReduce.create(dist.group.WORLD, device)
        assert impls[impl] is not None, f"one-shot all-reduce ({impl}) could not be set up"
    rows = []
    for nbytes in [int(k) << 10 for k in args.sizes.split(",") if k]:
        n = nbytes // 2
        g = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(n, device=device, dtype=torch.float16, generator=g)
        ref = x.clone()
        dist.all_reduce(ref)
        y = x.clone()
        row = {"bytes": nbytes, "nccl_eager_us": _time(lambda: dist.all_reduce(y), 200)}
        try:
            row["nccl_graph_us"] = _graph_time(lambda: dist.all_reduce(y), 20, 20)
        except Exception as e:  # noqa: BLE001 - report and go on
            row["nccl_graph_error"] = f"{type(e).__name__}: {e}"[:200]
        for impl, op in impls.items():
            try:
                got = op(x)
                row[f"{impl}_equal_to_nccl"] = bool(torch.equal(ref, got))
                row[f"{impl}_eager_us"] = _time(lambda: op(x), 200)
                row[f"{impl}_graph_us"] = _graph_time(lambda: op(x), 20, 20)
                row[f"{impl}_equal_after_graphs"] = bool(torch.equal(ref, op(x)))
            except Exception as e:  # noqa: BLE001
                row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    # the decoder layer's all-reduce + residual add + RMSNorm: the fused Lamport kernel against each all-reduce
    # followed by the norm kernel (Llama-2-13B's hidden size; 1 and 32 rows)
    from rooflm.kernels.rmsnorm import rms_norm

    for rows_ in (1, 32):
        g = torch.Generator(device=device).manual_seed(rank + 7)
        x = torch.randn(rows_, 5120, device=device, dtype=torch.float16, generator=g)
        same = torch.Generator(device=device).manual_seed(3)  # the residual and norm weight: the same on every rank
        res = torch.randn(rows_, 5120, device=device, dtype=torch.float16, generator=same)
        w = torch.rand(5120, device=device, dtype=torch.float16, generator=same)
        row = {"fused_norm_rows": rows_}
        fused = impls["lamport"].all_reduce_rms_norm(x, res, w, 1e-5)
        ref_out, ref_res = rms_norm(impls["triton"](x), w, 1e-5, res)
        row["fused_residual_equal"] = bool(torch.equal(fused[1], ref_res))
        row["fused_out_max_diff"] = float((fused[0].float() - ref_out.float()).abs().max())
        row["lamport_fused_graph_us"] = _graph_time(lambda: impls["lamport"].all_reduce_rms_norm(x, res, w, 1e-5),
                                                    20, 20)
        for impl in ("lamport", "triton"):
            row[f"{impl}_then_norm_graph_us"] = _graph_time(lambda impl=impl: rms_norm(impls[impl](x), w, 1e-5, res),
                                                            20, 20)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    one_shot = impls["triton"]
    # the vocabulary-parallel logits gather, uneven widths
    sizes = [16001, 15999][:world] if world == 2 else [32000 // world] * world
    x = torch.randn(3, sizes[rank], device=device, dtype=torch.float32)
    parts = [torch.empty(3, max(sizes), device=device) for _ in sizes]
    dist.all_gather(parts, torch.nn.functional.pad(x, (0, max(sizes) - sizes[rank])))
    ref = torch.cat([p[:, :w] for p, w in zip(parts, sizes)], dim=-1)
    gather_ok = bool(torch.equal(ref, gather_by_sum(x, sizes, rank, one_shot)))
    if rank == 0:
        print(json.dumps({"gather_equal_to_nccl": gather_ok}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world, "device": torch.cuda.get_device_name(device), "rows": rows,
                           "gather_equal_to_nccl": gather_ok}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
