#!/usr/bin/env bash
# Expert parallelism against tensor-parallel expert slices on a machine with 2 or 4 GPUs; run from the repository
# root: bash tests/gpu/ep_bench.sh [N]   (N: the GPUs to use, default all of them, at most 4)
# 1. the token tests of Mixtral (fused MoE kernels against the expert loop on one GPU; EP=2 and TP=2 against one
#    GPU), unless TESTS=0;
# 2. Mixtral-8x7B (random fp16 weights), 512 prompt + 64 generated tokens, at batch 1, 32 and 128 (BATCHES), on N
#    GPUs with -tp N --enable-expert-parallel and with -tp N alone (SPLITS="ep tp"). One JSON per run goes to $OUT
#    (default ./out), and a summary line per run (TPOT, decode tok/s) is printed at the end. RUN_TIMEOUT: seconds a
#    run may take (default 900).
# Mixtral-8x7B fp16 is about 87 GiB of weights: N=2 needs 80 GB cards (about 44 GiB per card plus the KV pool).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
N=${1:-$(( GPUS < 4 ? GPUS : 4 ))}
if [ "$N" -lt 2 ] || [ "$N" -gt "$GPUS" ]; then
  echo "ep_bench.sh: N=$N: needs 2 to $GPUS GPUs on this machine" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv
BATCHES=${BATCHES:-1 32 128}
SPLITS=${SPLITS:-ep tp}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
if [ "${TESTS:-1}" != 0 ]; then
  timeout 400 python3 -m pytest tests/gpu/test_gpu_ep.py -q -rs -p no:cacheprovider 2>&1 | tail -20
fi
LAT="python3 -m rooflm.cli bench latency --model mixtral-8x7b --load-format dummy --dtype float16 \
  --input-len 512 --output-len 64 --num-iters 2 --yes"
for B in $BATCHES; do
  for S in $SPLITS; do
    FLAG=$([ "$S" = ep ] && echo --enable-expert-parallel)
    timeout "$RUN_TIMEOUT" $LAT --batch-size "$B" -tp "$N" $FLAG --json "$OUT/mixtral_${S}${N}_b${B}.json" 2>&1 \
      | tail -8
  done
done
python3 - "$OUT" "$N" <<'PY'
import json, os, sys
out, n = sys.argv[1], sys.argv[2]
print(f"{'run':<16}{'batch':>6}{'TPOT ms':>10}{'decode tok/s':>14}{'TTFT ms':>10}")
for b in (1, 32, 128):
    for kind in ("ep", "tp"):
        path = os.path.join(out, f"mixtral_{kind}{n}_b{b}.json")
        if not os.path.exists(path):
            print(f"{kind}{n:<15}{b:>6}  (no result: see the log above)")
            continue
        d = json.load(open(path))
        print(f"{kind + n:<16}{b:>6}{d['tpot_s'] * 1e3:>10.2f}{d['decode_tok_s']:>14.1f}{d['ttft_s'] * 1e3:>10.1f}")
PY
