#!/usr/bin/env bash
# The runs of four (or eight) GPUs, one section per call (each fits one 10-minute command); run from the repository
# root: bash tests/gpu/multi_gpu_runs.sh SECTION [N]   (N: GPUs, default all of them). JSON goes to $OUT.
#   llama    Llama-2-70B and Llama-3-70B (random fp16 weights) at -tp N: batch 1 and 32 decode after a 2048-token
#            prefill (1.0 GB of weights per layer-step: the TPOT bound is printed beside each run), and -tp 2 on the
#            same machine where it fits, for the scaling against two GPUs
#   mixtral  Mixtral-8x7B with -tp N --enable-expert-parallel and with -tp N (tests/gpu/ep_bench.sh N)
#   pp       Llama-3-70B: bench throughput 512 x (512 in, 128 out) at -tp N/2 -pp 2 and at -tp N
#   serve    rooflm serve -tp N under bench serve at 64 concurrent requests, then /metrics (the server needs the
#            "server" extra: carry fastapi, uvicorn, starlette and their dependencies as wheels in .gpu_assets/)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
SECTION=${1:?section: llama, mixtral, pp or serve}
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
N=${2:-$GPUS}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
COMMON="--load-format dummy --dtype float16 --yes"
case "$SECTION" in
llama)
  for M in llama-2-70b llama-3-70b; do
    for B in 1 32; do
      timeout 280 python3 -m rooflm.cli bench latency --model $M $COMMON --input-len 2048 --output-len 64 \
        --num-iters 1 --num-iters-warmup 1 --batch-size $B -tp $N --json "$OUT/${M}_tp${N}_b${B}.json" 2>&1 | tail -5
    done
  done
  timeout 280 python3 -m rooflm.cli bench latency --model llama-2-70b $COMMON --input-len 2048 --output-len 64 \
    --num-iters 1 --num-iters-warmup 1 --batch-size 1 -tp 2 --json "$OUT/llama-2-70b_tp2_b1.json" 2>&1 | tail -5
  ;;
mixtral)
  bash tests/gpu/ep_bench.sh "$N"
  ;;
pp)
  TP=$(( N / 2 ))
  timeout 280 python3 -m rooflm.cli bench throughput --model llama-3-70b $COMMON --num-prompts 512 --input-len 512 \
    --output-len 128 -tp $TP -pp 2 --json "$OUT/llama-3-70b_tp${TP}_pp2_throughput.json" 2>&1 | tail -5
  timeout 280 python3 -m rooflm.cli bench throughput --model llama-3-70b $COMMON --num-prompts 512 --input-len 512 \
    --output-len 128 -tp $N --json "$OUT/llama-3-70b_tp${N}_throughput.json" 2>&1 | tail -5
  ;;
serve)
  python3 -m pip install -q --no-index --no-deps .gpu_assets/*.whl 2>&1 | tail -2
  # Llama-2-70B's shape with the SmolLM2 tokenizer saved in .gpu_assets (a named config has no tokenizer, and the
  # server takes text): the vocabulary grows to the tokenizer's 49152 entries, random weights
  MODEL="$OUT/llama-2-70b-smoltok"
  python3 - "$MODEL" <<'PY'
import json, os, shutil, sys
from rooflm.config import load_model_config
folder = sys.argv[1]
shutil.copytree(".gpu_assets/smollm2-tokenizer", folder, dirs_exist_ok=True)
cfg = dict(load_model_config("llama-2-70b").hf_config, vocab_size=49152)
with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(cfg, f)
PY
  python3 -m rooflm.cli serve --model "$MODEL" --tokenizer "$MODEL" --load-format dummy --dtype float16 -tp $N --port 8123 \
    > "$OUT/serve.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8123/health > /dev/null && break; sleep 2; done
  timeout 300 python3 -m rooflm.cli bench serve --base-url http://127.0.0.1:8123 --num-prompts 256 \
    --max-concurrency 64 --json "$OUT/serve_tp${N}.json" 2>&1 | tail -12
  curl -s http://127.0.0.1:8123/metrics | grep -E "^rooflm_(num_requests|kv_cache|requests_)" | head -20
  kill -INT $SERVER; wait $SERVER; echo "server exit code $?"
  ;;
*)
  echo "multi_gpu_runs.sh: unknown section '$SECTION' (llama, mixtral, pp or serve)" >&2
  exit 2
  ;;
esac
