#!/usr/bin/env bash
# Multi-GPU check on the GPU machine (issue 7): NCCL collectives through llmc_cli.parallel.comm, then GPT-2 d12
# (B=64 per GPU, T=1024, bf16, ZeRO-1) on 1 GPU and on N GPUs with `llmc train --gpus N`.
#   bash backends/cuda/bench/multi_gpu.sh [N=2] [STEPS=30]     (logs under $OUT or ./multi_gpu_out)
set -u
N=${1:-2}; STEPS=${2:-30}
OUT=${OUT:-$PWD/multi_gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-deps --no-build-isolation --no-compile -e . -e backends/cpu -e backends/cuda 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.log"
nvidia-smi topo -m 2>&1 | head -5 | tee -a "$OUT/env.log"
$PY backends/cuda/bench/nccl_check.py "$N" 2>&1 | tee "$OUT/nccl_check.log"
mkdir -p /tmp/llmc_data
$PY - <<'PYEOF'
import numpy as np
from llmc_cli.data.loader import write_shard
rng = np.random.default_rng(0)
write_shard("/tmp/llmc_data/synth_train_000.bin", rng.integers(0, 50257, 20_000_000).astype(np.uint16))
PYEOF
ARGS="--backend cuda --dtype bf16 --model d12 -b 64 -t 1024 --steps $STEPS --zero 1 --val-every 0 --sample-every 0 --data /tmp/llmc_data/synth_train_*.bin"
[ "${SKIP1:-0}" = 1 ] || timeout 200 llmc train $ARGS --log "$OUT/d12_1gpu.jsonl" 2>&1 | tee "$OUT/d12_1gpu.log"
timeout 200 llmc train $ARGS --gpus "$N" --log "$OUT/d12_${N}gpu.jsonl" 2>&1 | tee "$OUT/d12_${N}gpu.log"
$PY - "$OUT" "$N" <<'PYEOF'
import json, sys, statistics
out, n = sys.argv[1], int(sys.argv[2])
def rate(f):
    recs = [json.loads(l) for l in open(f) if '"tok_per_s"' in l]
    recs = recs[3:]  # skip warm-up steps
    return statistics.median(r["tok_per_s"] for r in recs), [round(r["loss"], 4) for r in recs[:3]]
one, l1 = rate(f"{out}/d12_1gpu.jsonl")
many, ln = rate(f"{out}/d12_{n}gpu.jsonl")
print(f"d12 1 GPU: {one:,.0f} tok/s; {n} GPUs: {many:,.0f} tok/s; scaling efficiency {many / (n * one):.1%}")
PYEOF
