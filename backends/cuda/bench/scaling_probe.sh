#!/usr/bin/env bash
# Where two GPUs' data-parallel step loses time, in one call (issue 20's scaling goal):
#   1. p2p_probe.py: what the link moves without NCCL (copy engines, kernels loading / storing peer memory)
#   2. nccl_check.py under NCCL settings (NCCL_CONFIGS, ';'-separated): all-reduce, reduce-scatter, all-gather of d12's
#      bf16 gradient
#   3. GPT-2 d12 B=64/GPU on 2 GPUs with the ranks on GPUs 0,1 and on 1,0, alternated (ROUNDS), each rank's phases
#      (LLMC_STEP_PHASES): is rank 0 slower because of its GPU or because it is rank 0?
#   bash backends/cuda/bench/scaling_probe.sh [STEPS=30]        (logs under $OUT or ./scaling_probe_out)
set -u
export OUT=${OUT:-$PWD/scaling_probe_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
STEPS=${1:-30}; ROUNDS=${ROUNDS:-2}
(cd /tmp && timeout 120 $PY "$HERE/backends/cuda/bench/p2p_probe.py") 2>&1 | tail -n 20 | tee "$OUT/p2p_probe.log"
IFS=';' read -ra CONFIGS <<< "${NCCL_CONFIGS:-NCCL_DEFAULTS=1;NCCL_PROTO=Simple;NCCL_MIN_CTAS=32 NCCL_MAX_CTAS=32;NCCL_BUFFSIZE=16777216;NCCL_P2P_USE_CUDA_MEMCPY=1}"
for cfg in "${CONFIGS[@]}"; do
  echo "== $cfg" | tee -a "$OUT/nccl.log"
  (cd /tmp && env $cfg timeout 90 $PY "$HERE/backends/cuda/bench/nccl_check.py" 2) 2>&1 | grep -E "all-reduce|WRONG|rror" \
    | tee -a "$OUT/nccl.log"
done
[ -n "${NO_TRAIN:-}" ] && exit $rc
mkdir -p /tmp/llmc_data /tmp/runs
$PY -c "import numpy as np; from llmc_cli.formats.shards import write_shard; \
write_shard('/tmp/llmc_data/synth_train_000.bin', np.random.default_rng(0).integers(0, 50257, 20_000_000))"
LOGS=/tmp/scaling_probe_logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
for r in $(seq "$ROUNDS"); do
  for map in 0,1 1,0; do
    name="d12_2gpu_on${map/,/}_$r"
    (cd /tmp/runs && CUDA_VISIBLE_DEVICES=$map LLMC_STEP_PHASES=$LOGS/phases/$name timeout 240 $LLMC train \
      --backend cuda --dtype bf16 --model d12 -b 64 -t 1024 --zero 1 --gpus 2 --steps "$STEPS" --val-every 0 \
      --sample-every 0 --data '/tmp/llmc_data/synth_train_*.bin' > "$LOGS/$name.log" 2>&1) || { rc=1; tail -n 3 "$LOGS/$name.log"; }
    $PY "$HERE/bench/train_median.py" --skip 5 "$LOGS/$name.log" | tee -a "$OUT/medians.log"
  done
done
$PY "$HERE/bench/step_phases.py" "$LOGS"/phases/* | tee "$OUT/phases.log"
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
exit $rc
