#!/usr/bin/env bash
# Does llmc's on-disk cache cost a run speed? GPT-2 d12 (B=64, T=1024, bf16) on GPU 0, one seeding run that fills a
# cache, then rounds of four runs alternated: with the whole seeded cache (`full`), with it less the cuBLASLt
# decisions (`nolt`: the run races its products again), less the cuDNN plans (`nocudnn`), and with an empty cache
# (`fresh`). Medians of steps after the first 5; each run's decisions are copied to $OUT/decisions_<run>.json.
#   bash backends/cuda/bench/cache_probe.sh [STEPS=200]     ROUNDS=2 KINDS="full nolt nocudnn fresh" ...
set -u
export OUT=${OUT:-$PWD/cache_probe_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
STEPS=${1:-200}; ROUNDS=${ROUNDS:-2}
mkdir -p /tmp/llmc_data /tmp/runs
$PY -c "import numpy as np; from llmc_cli.formats.shards import write_shard; \
write_shard('/tmp/llmc_data/synth_train_000.bin', np.random.default_rng(0).integers(0, 50257, 20_000_000))"
LOGS=/tmp/cache_probe_logs; rm -rf "$LOGS" /tmp/cache_seed; mkdir -p "$LOGS"
one() {  # one NAME CACHE_DIR
  (cd /tmp/runs && CUDA_VISIBLE_DEVICES=0 LLMC_CACHE_DIR=$2 LLMC_STEP_PHASES=$LOGS/phases/$1 timeout 240 \
    $LLMC train --backend cuda --dtype bf16 --model d12 -b 64 -t 1024 --steps "$STEPS" --val-every 0 \
    --sample-every 0 --data '/tmp/llmc_data/synth_train_*.bin' > "$LOGS/$1.log" 2>&1) || { rc=1; tail -n 3 "$LOGS/$1.log"; }
  $PY "$HERE/bench/train_median.py" --skip 5 "$LOGS/$1.log" | tee -a "$OUT/medians.log"
  cp "$2"/cuda/*/cublaslt-*.json "$OUT/decisions_$1.json" 2>/dev/null
}
one seed /tmp/cache_seed
for r in $(seq "$ROUNDS"); do
  for kind in ${KINDS:-full nolt nocudnn fresh}; do
    c=$(mktemp -d)
    [ "$kind" = fresh ] || cp -r /tmp/cache_seed/. "$c"
    case $kind in
      nolt) rm -f "$c"/cuda/*/cublaslt-*.json ;;
      nocudnn) rm -rf "$c"/cuda/*/cudnn-* ;;
    esac
    one "${kind}_$r" "$c"
  done
done
$PY "$HERE/bench/step_phases.py" "$LOGS"/phases/* | tee "$OUT/phases.log"
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
exit $rc
