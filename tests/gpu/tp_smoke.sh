#!/usr/bin/env bash
# Tensor and pipeline parallelism on a machine with two GPUs; run from the repository root: bash tests/gpu/tp_smoke.sh
# 1. the two-GPU token tests (TP=2 and PP=2 against one GPU); 2. Llama-2-13B (random fp16 weights), batch 1, 1024
# prompt + 128 generated tokens: one GPU with CUDA graphs off and on, two GPUs with TP=2 and with PP=2, and TP=2 with
# its experimental CUDA graphs. JSON goes to $OUT (default ./out).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 300 python3 -m pytest tests/gpu/test_gpu_tp.py -q -rs -p no:cacheprovider -s 2>&1 | tail -20
LAT="python3 -m rooflm.cli bench latency --model llama-2-13b --load-format dummy --dtype float16 --batch-size 1 \
  --input-len 1024 --output-len 128"
timeout 300 $LAT --enforce-eager --json "$OUT/lat13b_tp1_eager.json" 2>&1 | tail -15
timeout 300 $LAT --json "$OUT/lat13b_tp1_graphs.json" 2>&1 | tail -15
timeout 420 $LAT -tp 2 --json "$OUT/lat13b_tp2.json" 2>&1 | tail -15
timeout 420 $LAT -pp 2 --json "$OUT/lat13b_pp2.json" 2>&1 | tail -15
# experimental: decode CUDA graphs with the NCCL collectives recorded in them
ROOFLM_TP_CUDA_GRAPHS=1 timeout 420 $LAT -tp 2 --json "$OUT/lat13b_tp2_graphs.json" 2>&1 | tail -15
