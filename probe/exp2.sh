#!/bin/bash
cd "$(dirname "$0")/.."
export PYTHONPATH=src
B="gu_late,gu_pre,dn_pre,dn_late,qkv_pre"
V=("" "$B" "$B,o_late" "$B,pre2" "gu_late,gu_pre,dn_late" "gu_late,gu_pre,dn_late,qkv_pre" "$B,o_late,pre2")
for r in 1 2; do
  for v in "${V[@]}"; do
    ROOFLM_PDL_EXP="$v" python3 probe/bl.py --model llama-2-7b --load-format dummy --dtype float16 --batch-size 1 \
      --input-len 1024 --output-len 128 --num-iters 3 --json $OUT/r.json > $OUT/log.txt 2>&1
    t=$(python3 -c "import json;d=json.load(open('$OUT/r.json'));print('%.4f ms %.2f%%'%(d['tpot_s']*1e3,100*d['fraction_of_roofline_tpot']))")
    echo "round $r [$v] $t" | tee -a $OUT/summary.txt
  done
done
