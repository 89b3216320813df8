#!/usr/bin/env bash
# The one-shot all-reduce on two GPUs: tests/gpu/allreduce_bench.py (latency and bit-for-bit agreement with NCCL),
# then Llama-2-13B (random fp16 weights) at TP=2, batch 1 (with a profile) and 32, then tests/gpu/test_gpu_tp.py.
# Run from the repository root; JSON and logs go to $OUT.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 150 torchrun --nproc-per-node 2 tests/gpu/allreduce_bench.py --json $OUT/allreduce.json > $OUT/bench.log 2>&1
grep -E '^\{' $OUT/bench.log | python3 -c "
import sys,json
for l in sys.stdin:
    d=json.loads(l); print({k:(round(v,1) if isinstance(v,float) else v) for k,v in d.items() if 'error' not in k}, [k for k in d if 'error' in k])"
grep -m3 -E "Error|error" $OUT/bench.log | cut -c1-300
if grep -q '"triton_equal_after_graphs": true' $OUT/bench.log; then echo TRITON_OK; else export ROOFLM_TP_ALLREDUCE=torch; echo USING_TORCH; fi
LAT="python3 -m rooflm.cli bench latency --model llama-2-13b --load-format dummy --dtype float16 --input-len 1024 --output-len 128 --num-iters 2 --num-iters-warmup 1 -tp 2"
timeout 200 $LAT --batch-size 1 --profile $OUT/prof_tp2_bs1.txt --json $OUT/lat13b_tp2_bs1.json > $OUT/l1.log 2>&1; grep -E "tok/s|rror" $OUT/l1.log | head -3
timeout 150 $LAT --batch-size 32 --json $OUT/lat13b_tp2_bs32.json > $OUT/l32.log 2>&1; grep -E "tok/s|rror" $OUT/l32.log | head -3
timeout 240 python3 -m pytest tests/gpu/test_gpu_tp.py -q -rs -p no:cacheprovider 2>&1 | tail -6
