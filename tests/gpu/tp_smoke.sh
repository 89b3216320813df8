#!/usr/bin/env bash
# Tensor and pipeline parallelism on a machine with two GPUs; run from the repository root: bash tests/gpu/tp_smoke.sh
# 1. all-reduce latency, NCCL against the one-shot kernels (eager and in CUDA graphs), and the fused all-reduce + add
# + RMSNorm; 2. Llama-2-13B (random fp16 weights), 1024 prompt + 128 generated tokens: one GPU with CUDA graphs, TP=2
# with each all-reduce path in MODES (ROOFLM_TP_ALLREDUCE values; decode CUDA graphs on), TP=2 with NCCL and no graphs,
# PP=2; 3. the two-GPU token tests. JSON goes to $OUT.
# Environment: BATCHES (default "1 32"), MODES (default "auto"), SLOW=0 skips the NCCL-eager and PP=2 runs,
# TESTS=0 skips the token tests, BENCH=0 skips the all-reduce benchmark.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
BATCHES=${BATCHES:-1 32}
MODES=${MODES:-auto}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
nvidia-smi topo -m 2>&1 | head -4
if [ "${BENCH:-1}" != 0 ]; then
  timeout 150 torchrun --nproc-per-node 2 tests/gpu/allreduce_bench.py --json "$OUT/allreduce.json" 2>&1 \
    | grep -v Warning | tail -12
fi
LAT="python3 -m rooflm.cli bench latency --model llama-2-13b --load-format dummy --dtype float16 --input-len 1024 \
  --output-len 128 --num-iters 2 --num-iters-warmup 1"
for bs in $BATCHES; do
  timeout 240 $LAT --batch-size $bs --json "$OUT/lat13b_tp1_bs$bs.json" 2>&1 | tail -4
  for mode in $MODES; do
    ROOFLM_TP_ALLREDUCE=$mode timeout 300 $LAT --batch-size $bs -tp 2 --json "$OUT/lat13b_tp2_${mode}_bs$bs.json" \
      2>&1 | tail -4
  done
done
if [ "${SLOW:-1}" != 0 ]; then
  ROOFLM_TP_ALLREDUCE=nccl ROOFLM_TP_CUDA_GRAPHS=0 timeout 300 $LAT --batch-size 1 -tp 2 \
    --json "$OUT/lat13b_tp2_nccl_eager.json" 2>&1 | tail -4
  timeout 300 $LAT --batch-size 1 -pp 2 --json "$OUT/lat13b_pp2.json" 2>&1 | tail -4
fi
if [ "${TESTS:-1}" != 0 ]; then
  timeout 420 python3 -m pytest tests/gpu/test_gpu_tp.py -q -rs -p no:cacheprovider 2>&1 | tail -8
fi
