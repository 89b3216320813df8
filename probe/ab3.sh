#!/bin/bash
cd "$(dirname "$0")/.."
run() {
  PYTHONPATH=$2 python3 -m rooflm.cli bench latency --model llama-2-7b --load-format dummy --dtype float16 \
    --batch-size ${BS:-1} --input-len 1024 --output-len 128 --num-iters 3 $3 --json $OUT/r.json > $OUT/log_$1.txt 2>&1
  t=$(python3 -c "import json;d=json.load(open('$OUT/r.json'));print('%.4f ms %.1f tok/s %.2f%% bound %.4f ms'%(d['tpot_s']*1e3,1/d['tpot_s'],100*d['fraction_of_roofline_tpot'],d['roofline']['tpot_s']*1e3))")
  echo "$1 $3 BS=${BS:-1}: $t" | tee -a $OUT/summary.txt
}
for r in 1 2; do run new src ""; run prev probe/prev/src ""; done
run new src "--quantization w4a16"; run new src "--quantization w8a16"; run new src ""
BS=32 run new src ""
