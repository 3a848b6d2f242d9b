#!/usr/bin/env bash
# Why one GPU of a pair computes slower while the other works (docs/performance.md, 2026-11-26): GPT-2 d12 B=64
# on GPU 0 alone, then on both (--gpus 2), nvidia-smi sampling every 200 ms each GPU's SM clock, power, temperature
# and the active clock-throttle reasons; summarized per run and GPU over the busy samples (power > 300 W).
#   bash backends/cuda/bench/clocks_check.sh [STEPS=100]        (logs under $OUT or ./clocks_check_out)
set -u
export OUT=${OUT:-$PWD/clocks_check_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
STEPS=${1:-100}
mkdir -p /tmp/llmc_data /tmp/runs
$PY -c "import numpy as np; from llmc_cli.formats.shards import write_shard; \
write_shard('/tmp/llmc_data/synth_train_000.bin', np.random.default_rng(0).integers(0, 50257, 20_000_000))"
# (newer drivers name the throttle reasons "clock event reasons")
Q=clocks_event_reasons.active
nvidia-smi --query-gpu=$Q --format=csv,noheader > /dev/null 2>&1 || Q=clocks_throttle_reasons.active
A="--backend cuda --dtype bf16 --model d12 -b 64 -t 1024 --zero 1 --val-every 0 --sample-every 0"
for run in one two; do
  nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu,$Q \
    --format=csv,noheader,nounits -lms 200 > "$OUT/smi_$run.csv" &
  SMI=$!
  if [ $run = one ]; then G="CUDA_VISIBLE_DEVICES=0"; X=""; else G="LLMC_X=1"; X="--gpus 2"; fi
  (cd /tmp/runs && env $G timeout 200 $LLMC train $A $X --steps "$STEPS" --data '/tmp/llmc_data/synth_train_*.bin' \
    > "$OUT/train_$run.log" 2>&1) || { rc=1; tail -n 3 "$OUT/train_$run.log"; }
  kill $SMI
  $PY "$HERE/bench/train_median.py" --skip 5 "$OUT/train_$run.log" | tee -a "$OUT/summary.log"
done
$PY - "$OUT" <<'PYEOF' | tee -a "$OUT/summary.log"
import collections, statistics, sys
for run in ("one", "two"):
    rows = collections.defaultdict(list)
    for line in open(f"{sys.argv[1]}/smi_{run}.csv"):
        p = [x.strip() for x in line.split(",")]
        try:
            gpu, clk, pwr, temp, why = int(p[0]), float(p[1]), float(p[2]), float(p[3]), p[4]
        except (ValueError, IndexError):
            continue
        if pwr > 300:
            rows[gpu].append((clk, pwr, temp, why))
    for gpu, r in sorted(rows.items()):
        reasons = collections.Counter(x[3] for x in r).most_common(3)
        print(f"{run} GPU {gpu}: {len(r)} busy samples, SM clock median {statistics.median(x[0] for x in r):.0f} MHz "
              f"(min {min(x[0] for x in r):.0f}), power median {statistics.median(x[1] for x in r):.0f} W "
              f"(max {max(x[1] for x in r):.0f}), temperature max {max(x[2] for x in r):.0f} C, throttle reasons "
              f"{reasons}")
PYEOF
exit $rc
