#!/usr/bin/env bash
# The prefix cache's host tier (--kv-offload-gb) and H2O on one GPU; run from the repository root:
#   bash tests/gpu/multiturn_offload.sh
# 1. the GPU tests (host tier against recompute, pinned buffers, sync and async; H2O on the Triton path);
# 2. the multi-turn chat benchmark on Llama-3-8B and Llama-2-7B shapes (random fp16 weights): 16 users x 6 turns of 256 new user
#    tokens + 64 answer tokens (a working set of 30720 tokens, 15 GiB of KV), a device pool of a quarter of it, without
#    and with a host tier holding the whole working set (auto); mean TTFT and prompt tokens computed for each.
# JSON goes to $OUT (default ./out).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 420 python3 -m pytest tests/gpu/test_gpu_kv_offload.py -q -rs -p no:cacheprovider 2>&1 | tail -20
for model in llama-3-8b llama-2-7b; do
  timeout 300 python3 -m rooflm.cli bench multiturn --model $model --load-format dummy --dtype float16 \
    --num-users 16 --num-turns 6 --input-len 256 --output-len 64 --pool-fraction 0.25 --kv-offload-gb 0,auto \
    --json "$OUT/multiturn_$model.json" 2>&1 | tail -8
done
