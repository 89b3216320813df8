#!/usr/bin/env bash
# One call on a GPU machine: run from the repository root as
#   bash tests/gpu/device_session.sh STAGE...      (stages: info tests kbench latency1 latency32 prefill throughput
#                                                   qlat fp8pre qdepths qwide qmlp qmlpsweep dataflow qtests kvlat qsweep
#                                                   offload newtests swap hostcopy kvoffload multiturn specasync mixtral2
#                                                   verifygraphs medusagpu ropefuse)
# JSON and profiles go to $OUT (or ./out), every stage's log is appended to $OUT/all.log (the device tool returns at
# most 8 files). Every stage has its own time limit, so one failure does not sink the call.
# qsweep's grid: QSWEEP_Q (default: none w8a16 w4a16), QSWEEP_BATCH (1 16), QSWEEP_CTX (512 4000).
# qwide: float16, then W4A16 and W8A16 with the word GEMV's picker as by default and with ROOFLM_QUANT_GEMV=wide
# (QWIDE_Q, QWIDE_MODES). qdepths: the word GEMV's candidates at each prefetch depth and L2 distance (QDEPTHS_FORMATS,
# QDEPTHS_SHAPES, QDEPTHS_L2). qmlp: the fused packed MLP's tests, then `bench latency` at one row for each of
# QMLP_Q (default: none w4a16) in each source tree of QMLP_TREES (default: src; e.g. "src .headsrc/src" alternates
# with an older tree; QMLP_TESTS=0 skips the tests). qmlpsweep: tests/gpu/quant_mlp_sweep.py (QMLP_FORMATS).
# dataflow: tests/gpu/dataflow_probe.py (a layer's five stages handing activations over by counters, not grid waits).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=python3
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%H:%M:%S), limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "/tmp/$name.log" 2>&1
  local rc=$?
  { echo "=== $name: $*"; cat "/tmp/$name.log"; } >> "$OUT/all.log"
  echo "--- $name rc=$rc in $((SECONDS - t0)) s; tail:"
  tail -n "${TAIL:-25}" "/tmp/$name.log"
}
for stage in "$@"; do
  case $stage in
    info) nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
          $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)";;
    tests) TAIL=30 run tests 300 $PY -m pytest tests/kernels tests/gpu -q -rs -p no:cacheprovider -s \
             -k "not engine_with" ;;
    tests_engine) run tests_engine 200 $PY -m pytest tests/gpu/test_gpu_model.py tests/gpu/test_gpu_async_engine.py -q -s \
                    -p no:cacheprovider -k "engine_with or async" ;;
    ropefuse) TAIL=12 run ropebench 200 $PY -m rooflm.kernels.bench --sections decode_rope --json "$OUT/ropebench.json"
              for i in ${ROPE_REPS:-1 2}; do for f in 1 0; do
                export ROOFLM_DECODE_FUSED_ROPE=$f
                TAIL=3 run "lat1_rope${f}_$i" 240 $PY -m rooflm.cli bench latency --model llama-2-7b --load-format dummy \
                  --batch-size ${ROPE_BATCH:-1} --input-len 1024 --output-len 128 --dtype float16 ${ROPE_ARGS:-} \
                  --json "$OUT/lat_rope${f}_$i.json"
              done; done; unset ROOFLM_DECODE_FUSED_ROPE ;;
    kbench) TAIL=80 run kbench 300 $PY -m rooflm.kernels.bench --json "$OUT/kbench.json" ;;
    kbench_quick) TAIL=30 run kbench 300 $PY -m rooflm.kernels.bench --sections ceilings,decode_attn,prefill_attn,decode --json "$OUT/kbench.json" ;;
    latency1) run latency1 300 $PY -m rooflm.cli bench latency --model llama-2-7b --load-format dummy --batch-size 1 --profile \
                --input-len 1024 --output-len 128 --dtype float16 --json "$OUT/latency1.json" ;;
    latency1_sync) run latency1_sync 240 $PY -m rooflm.cli bench latency --model llama-2-7b --load-format dummy --batch-size 1 \
                --async-scheduling off --input-len 1024 --output-len 128 --dtype float16 --json "$OUT/latency1_sync.json" ;;
    latency32) run latency32 300 $PY -m rooflm.cli bench latency --model llama-2-7b --load-format dummy --batch-size 32 --profile \
                 --input-len 1024 --output-len 128 --dtype float16 --num-iters 2 --json "$OUT/latency32.json" ;;
    prefill) run prefill 240 $PY -m rooflm.cli bench latency --model llama-2-7b --load-format dummy --batch-size 1 \
               --input-len 2048 --output-len 2 --dtype float16 --num-iters 5 --json "$OUT/prefill.json" ;;
    throughput) run throughput 420 $PY -m rooflm.cli bench throughput --model llama-2-7b --load-format dummy \
                  --num-prompts 256 --max-num-seqs 128 --input-len 512 --output-len 128 --dtype float16 \
                  --json "$OUT/throughput.json" ;;
    qlat) for q in none w8a16 w4a16; do
            run "qlat_$q" 150 $PY -m rooflm.cli bench latency --model llama-2-7b --load-format dummy --batch-size 1 \
              --input-len 1024 --output-len 128 --dtype float16 --num-iters 2 --quantization $q --json "$OUT/qlat_$q.json"
          done ;;
    fp8pre) for q in none fp8; do
              run "fp8pre_$q" 120 $PY -m rooflm.cli bench latency --model llama-2-7b --load-format dummy --batch-size 1 \
                --input-len 2048 --output-len 2 --dtype float16 --num-iters 5 --quantization $q --json "$OUT/fp8pre_$q.json"
            done ;;
    qwide) for q in ${QWIDE_Q:-none w4a16 w8a16}; do for mode in auto ${QWIDE_MODES:-wide}; do
             [ $q = none ] && [ $mode != auto ] && continue
             ROOFLM_QUANT_GEMV=$mode TAIL=6 run "qwide_${q}_$mode" 300 $PY -m rooflm.cli bench latency \
               --model llama-2-7b --load-format dummy --batch-size 1 --input-len 1024 --output-len 128 --dtype float16 \
               --num-iters 2 --quantization $q --json "$OUT/qwide_${q}_$mode.json"
           done; done ;;
    qmlp) [ "${QMLP_TESTS:-1}" = 1 ] && TAIL=30 run qmlp_tests 150 $PY -m pytest -q -p no:cacheprovider \
            tests/kernels/test_quant_mlp.py tests/gpu/test_gpu_quant_mlp.py tests/gpu/test_gpu_quant_gemm.py -k "mlp or hands_the_norms"
          for q in ${QMLP_Q:-none w4a16}; do for tree in ${QMLP_TREES:-src}; do
            PYTHONPATH=$tree ROOFLM_GEMV=verbose ROOFLM_QUANT_MLP=${QMLP_MODE:-auto} TAIL=8 \
              run "qmlp_${q}_${tree//[\/.]/}_${QMLP_MODE:-auto}" 200 $PY -m rooflm.cli bench latency --model llama-2-7b \
              --load-format dummy --batch-size 1 --input-len 1024 --output-len 128 --dtype float16 --num-iters 2 --quantization $q --json "$OUT/qmlp_${q}_${tree//[\/.]/}_${QMLP_MODE:-auto}.json"
          done; done ;;
    dataflow) TAIL=12 run dataflow 240 $PY tests/gpu/dataflow_probe.py ;;
    qmlpsweep) TAIL=40 run qmlpsweep 480 $PY tests/gpu/quant_mlp_sweep.py --formats ${QMLP_FORMATS:-w4g128,w8} \
                 --json "$OUT/qmlpsweep.json" ;;
    qdepths) TAIL=40 run qdepths 480 $PY tests/gpu/quant_gemv_sweep.py --formats ${QDEPTHS_FORMATS:-w4g128} \
               --shapes ${QDEPTHS_SHAPES:-qkv,o,gate_up,down} --grid depths --depths 0,1,2 \
               --l2-ahead ${QDEPTHS_L2:-0,4} --top 3 --json "$OUT/qdepths.json" ;;
    qtests) TAIL=15 run qtests 200 $PY -m pytest tests/gpu/test_gpu_quant_gemm.py tests/gpu/test_gpu_kv_quant.py \
              tests/gpu/test_gpu_quant_fp8.py -q -rs -p no:cacheprovider ;;
    kvlat) for kv in auto int8 fp8; do
             run "kvlat_$kv" 150 $PY -m rooflm.cli bench latency --model llama-2-7b --load-format dummy --batch-size 16 \
               --input-len 4000 --output-len 64 --dtype float16 --num-iters 2 --kv-cache-dtype $kv \
               --json "$OUT/kvlat_$kv.json"
           done ;;
    qsweep) for q in ${QSWEEP_Q:-none w8a16 w4a16}; do for b in ${QSWEEP_BATCH:-1 16}; do for ctx in ${QSWEEP_CTX:-512 4000}; do
              TAIL=4 run "qsweep_${q}_b${b}_c${ctx}" 120 $PY -m rooflm.cli bench latency --model llama-2-7b \
                --load-format dummy --batch-size $b --input-len $ctx --output-len 32 --dtype float16 --num-iters 1 \
                --quantization $q --json "$OUT/qsweep.json.tmp"
              cat "$OUT/qsweep.json.tmp" >> "$OUT/qsweep.jsonl" 2>/dev/null; echo >> "$OUT/qsweep.jsonl"
            done; done; done; rm -f "$OUT/qsweep.json.tmp" ;;
    offload) TAIL=10 run offload_test 200 $PY -m pytest tests/gpu/test_gpu_weight_offload.py -q -p no:cacheprovider
             run offload_70b ${OFFLOAD_LIMIT:-420} $PY tests/gpu/offload_bench.py llama-2-70b 75 64 ;;
    newtests) TAIL=20 run newtests 300 $PY -m pytest tests/gpu/test_gpu_structured.py tests/gpu/test_gpu_swap.py \
                tests/gpu/test_gpu_weight_offload.py tests/gpu/test_gpu_async_engine.py -q -rs -p no:cacheprovider ;;
    swap) TAIL=8 run swap_tests 150 $PY -m pytest tests/gpu/test_gpu_swap.py -q -rs -p no:cacheprovider
          TAIL=14 run swap_bench 200 $PY -m rooflm.cli bench swap --model llama-2-7b --load-format dummy --dtype float16 \
            --json "$OUT/swap.json" ;;
    hostcopy) TAIL=30 run hostcopy 300 $PY tests/gpu/host_copy_bench.py copies multiturn ;;
    kvoffload) TAIL=8 run kvoffload_tests 200 $PY -m pytest tests/gpu/test_gpu_kv_offload.py -q -rs -p no:cacheprovider ;;
    multiturn) for m in ${MULTITURN_MODELS:-llama-2-7b llama-3-8b}; do
                 TAIL=5 run "multiturn_$m" 200 $PY -m rooflm.cli bench multiturn --model $m --load-format dummy \
                   --dtype float16 --num-users 16 --num-turns 6 --input-len 256 --output-len 64 --pool-fraction 0.25 \
                   --kv-offload-gb 0,auto --json "$OUT/multiturn_$m.json"
               done ;;
    specasync) TAIL=8 run specasync_tests 200 $PY -m pytest tests/gpu/test_gpu_spec_async.py -q -rs -p no:cacheprovider
               for spec in none ngram; do
                 extra=(); [ $spec = ngram ] && extra=(--speculative-config '{"method":"ngram","num_speculative_tokens":4}')
                 TAIL=6 CUDA_VISIBLE_DEVICES=0 run "specthr_$spec" 240 $PY -m rooflm.cli bench throughput --model llama-2-7b \
                   --load-format dummy --num-prompts 128 --max-num-seqs 64 --input-len 512 --output-len 128 \
                   --dtype float16 "${extra[@]}" --json "$OUT/specthr_$spec.json"
               done ;;
    verifygraphs) TAIL=8 run verify_graph_tests 300 $PY -m pytest tests/gpu/test_gpu_verify_graphs.py \
                    tests/gpu/test_gpu_spec_async.py -q -rs -p no:cacheprovider
                  TAIL=20 run verify_cost 300 $PY -m rooflm.cli bench spec --verify-cost --model llama-2-7b \
                    --load-format dummy --dtype float16 --verify-batch-sizes ${VERIFY_BATCHES:-1,8,64} \
                    --json "$OUT/verify_cost.json" ;;
    # Medusa heads self-distilled on the GPU for the embedded GGUF model; MEDUSA_GGUF names the file (the GPU
    # machine has no package index), the heads go to $OUT/medusa-heads
    medusagpu) TAIL=30 run medusa_train 480 $PY -m rooflm.cli train-medusa --model "$MEDUSA_GGUF" --device cuda \
                 --dtype float32 --self-distill ${DISTILL_N:-4096} --distill-len ${DISTILL_LEN:-256} --distill-prompt-len ${DISTILL_PROMPT_LEN:-64} \
                 --distill-eval 32 --steps ${MEDUSA_STEPS:-1000} --batch-size 16 --lr 2e-3 --out "$OUT/medusa-heads"
               TAIL=8 ROOFLM_TEST_GGUF="$MEDUSA_GGUF" run medusa_distill_test 200 $PY -m pytest tests/gpu/test_gpu_medusa_distill.py -q -rs \
                 -p no:cacheprovider ;;
    mixtral2) for mode in ${MIXTRAL_MODES:-tp ep}; do
                extra=(); [ $mode = ep ] && extra=(--enable-expert-parallel)
                TAIL=6 run "mixtral_${mode}2" ${MIXTRAL_LIMIT:-240} $PY -m rooflm.cli bench latency --model mixtral-8x7b --load-format dummy \
                  --dtype float16 --input-len 512 --output-len 32 --num-iters 1 --batch-size 1 -tp 2 --yes "${extra[@]}" \
                  --json "$OUT/mixtral_${mode}2_b1.json"
              done ;;
    *) echo "unknown stage $stage";;
  esac
done
