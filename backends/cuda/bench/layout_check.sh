#!/usr/bin/env bash
# The layout issue's check on the GPU machine, in one call: the CUDA tests of this tree, the device communicator
# (now the cuda plugin's) on every GPU here, and GPT-2 d12 (B=64, T=1024, bf16) of this tree against an older
# tree, runs alternated, medians compared.
#   bash backends/cuda/bench/layout_check.sh BEFORE_TREE [ROUNDS=2] [STEPS=40]    (logs under $OUT or ./layout_out)
# BEFORE_TREE: a checkout of the commit to compare with (e.g. `git archive <commit> | tar -x -C before_src`).
set -u
BEFORE=$(cd "${1:?give the tree to compare with}" && pwd); ROUNDS=${2:-2}; STEPS=${3:-40}
OUT=${OUT:-$PWD/layout_out}; mkdir -p "$OUT"
PY=${PY:-python3}; HERE=$PWD
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
NG=$(nvidia-smi -L | wc -l)
# carried wheels to /tmp/site; each tree (engine, cpu reference, cuda backend) installed into its own folder, so
# either runs with PYTHONPATH=/tmp/<tree>:/tmp/site from a neutral directory
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
for t in after before; do
  src=$([ $t = after ] && echo "$HERE" || echo "$BEFORE")
  $PY -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/$t "$src" "$src/backends/cpu" \
    "$src/backends/cuda" 2>&1 | tail -2
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.log"
rc=0
# 1. the CUDA tests of this tree (every test carrying the cuda marker)
PYTHONPATH=/tmp/after:/tmp/site timeout 420 $PY -m pytest -q -m cuda -p no:cacheprovider tests backends/cuda/tests 2>&1 \
  | tail -n 25 | tee "$OUT/tests_cuda.log"
# 2. a synthetic GPT-2 shard, then d12 runs alternated: before, after, before, after, ...
mkdir -p /tmp/llmc_data /tmp/runs
PYTHONPATH=/tmp/after:/tmp/site $PY - <<'PYEOF'
import numpy as np
from llmc_cli.formats.shards import write_shard
write_shard("/tmp/llmc_data/synth_train_000.bin", np.random.default_rng(0).integers(0, 50257, 20_000_000))
PYEOF
ARGS="train --backend cuda --dtype bf16 --model d12 -b 64 -t 1024 --steps $STEPS --val-every 0 --sample-every 0"
ARGS="$ARGS --data /tmp/llmc_data/synth_train_*.bin"
for r in $(seq "$ROUNDS"); do
  for t in before after; do
    (cd /tmp/runs && PYTHONPATH=/tmp/$t:/tmp/site timeout 240 $PY -m llmc_cli $ARGS > "$OUT/d12_${t}_$r.log" 2>&1) || rc=1
    $PY "$HERE/bench/train_median.py" --skip 5 "$OUT/d12_${t}_$r.log" | tee -a "$OUT/d12_medians.log"
  done
done
# 3. the cuda plugin's communicator on every GPU here: collectives, then d12 data parallel with ZeRO-1
if [ "$NG" -gt 1 ]; then
  (cd /tmp/runs && PYTHONPATH=/tmp/after:/tmp/site timeout 180 $PY "$HERE/backends/cuda/bench/nccl_check.py" "$NG") 2>&1 \
    | tail -n 20 | tee "$OUT/nccl_check.log"
  (cd /tmp/runs && PYTHONPATH=/tmp/after:/tmp/site timeout 240 $PY -m llmc_cli $ARGS --zero 1 --gpus "$NG" \
    > "$OUT/d12_${NG}gpu.log" 2>&1) || rc=1
  $PY "$HERE/bench/train_median.py" --skip 5 "$OUT/d12_${NG}gpu.log" | tee -a "$OUT/d12_medians.log"
fi
exit $rc
