"""The 4-bit word GEMV under Nsight Compute: where do its programs wait?

A plain read of the codes in the word GEMV's tiles runs 1.4-1.7x faster than the GEMV itself on the same bytes
(docs/benchmarks.md, "Where a 4-bit decode step's time goes"), and neither a register-prefetched nor a software-
pipelined main loop, nor the tensor-core form with half the instructions a code, closed that gap. This script
launches, once each inside the NVTX range "prof" (tuning and compilation happen before it): the word GEMV on qkv
(12288 x 4096) and o (4096 x 4096), 4 bits, group 128, with the tiles the picker chose on an H100; the plain tile
read of qkv's codes; and the float16 GEMV of o, which runs near its bytes. Run it under ncu:

    PYTHONPATH=src ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        --section SchedulerStats --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \\
        python3 tests/gpu/quant_gemv_ncu.py
"""
from __future__ import annotations

import torch

from rooflm.kernels import gemv as G
from rooflm.kernels.quant_gemv import QuantGemvConfig, launch_gemv
from rooflm.quantization.rtn import quantize_rtn
from stream_size_probe import tile_read  # this script's folder is first on sys.path when it runs


def main() -> None:
    torch.manual_seed(0)
    runs = []
    for (n, k), cfg in (((12288, 4096), QuantGemvConfig(16, 64, 1, 2, 3, prefetch=True)),
                        ((4096, 4096), QuantGemvConfig(16, 128, 1, 4, 3))):
        w = torch.randn(n, k, dtype=torch.float16, device="cuda") / 64
        pw = quantize_rtn(w, 4, 128)
        x = torch.randn(1, k, dtype=torch.float16, device="cuda")
        launch_gemv(x, pw, None, cfg)  # compiled outside the range
        runs.append(lambda x=x, pw=pw, cfg=cfg: launch_gemv(x, pw, None, cfg))
        if n == 12288:
            red = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
            codes = pw.qweight.view(torch.int32)
            tile_read(codes, red, 8, 128, 8)
            runs.append(lambda q=codes, red=red: tile_read(q, red, 8, 128, 8))
        else:
            G.linear(x, w)  # tuned outside the range
            runs.append(lambda x=x, w=w: G.linear(x, w))
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    for run in runs:
        run()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
