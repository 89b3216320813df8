#!/usr/bin/env bash
# Tensor and pipeline parallelism on a machine with two GPUs; run from the repository root: bash tests/gpu/tp_smoke.sh
# 1. all-reduce latency, NCCL against one-shot (eager and in CUDA graphs); 2. Llama-2-13B (random fp16 weights),
# batch 1 and 32, 1024 prompt + 128 generated tokens: one GPU with CUDA graphs, TP=2 (one-shot all-reduces + decode
# CUDA graphs, the default), TP=2 with NCCL and no graphs, PP=2; 3. the two-GPU token tests. JSON goes to $OUT.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
nvidia-smi topo -m 2>&1 | head -4
timeout 120 torchrun --nproc-per-node 2 tests/gpu/allreduce_bench.py --json "$OUT/allreduce.json" 2>&1 | grep -v Warning | tail -12
LAT="python3 -m rooflm.cli bench latency --model llama-2-13b --load-format dummy --dtype float16 --input-len 1024 \
  --output-len 128 --num-iters 2 --num-iters-warmup 1"
for bs in 1 32; do
  timeout 240 $LAT --batch-size $bs --json "$OUT/lat13b_tp1_bs$bs.json" 2>&1 | tail -4
  timeout 300 $LAT --batch-size $bs -tp 2 --json "$OUT/lat13b_tp2_bs$bs.json" 2>&1 | tail -4
done
ROOFLM_TP_ALLREDUCE=nccl ROOFLM_TP_CUDA_GRAPHS=0 timeout 300 $LAT --batch-size 1 -tp 2 \
  --json "$OUT/lat13b_tp2_nccl_eager.json" 2>&1 | tail -4
timeout 300 $LAT --batch-size 1 -pp 2 --json "$OUT/lat13b_pp2.json" 2>&1 | tail -4
timeout 300 python3 -m pytest tests/gpu/test_gpu_tp.py -q -rs -p no:cacheprovider 2>&1 | tail -8
