#!/usr/bin/env bash
# cuDNN attention's backward workspace on the GPU machine, one call (logs under $OUT or ./workspace_out):
#   1. the CUDA tests of cuDNN attention, its planned workspace and FP8's shared scratch
#   2. bench/attn_plans.py: every cuDNN plan of the forward and the deterministic backward, timed (SHAPES)
#   3. per model (MODELS: "d12 -b 64 -t 1024; ..."), `--dry-run`'s total, then `llmc bench train` at the default
#      workspace and at CAP MiB (default 512, the old default), alternated ROUNDS times (default 2), with the
#      device's memory in use; DTYPES (default bf16) each
#   4. PROFILE=MODEL: cuda_profile.py's per-kernel table of that model at the default (attention rows)
set -u
export OUT=${OUT:-$PWD/workspace_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
timeout 300 $PY -m pytest -q -p no:cacheprovider backends/cuda/tests/test_cuda.py \
  -k "cudnn or workspace or two_passes or graph" > "$OUT/tests.log" 2>&1 || rc=1
tail -n 6 "$OUT/tests.log"
(cd /tmp && timeout 200 $PY "$HERE/backends/cuda/bench/attn_plans.py" ${SHAPES:-}) 2>&1 | tee "$OUT/attn_plans.log"
cd /tmp
IFS=';' read -ra MS <<< "${MODELS:-d12 -b 64 -t 1024; llama3.2-1b -b 8 -t 2048}"
for m in "${MS[@]}"; do
  for dt in ${DTYPES:-bf16}; do
    echo "== $m --dtype $dt: dry-run $(timeout 60 $LLMC train --backend cuda --dtype $dt --model $m --dry-run 2>&1 \
      | grep -E 'cuDNN|total' | tr -s ' ' | tr '\n' ' ')" | tee -a "$OUT/summary.log"
    for r in $(seq "${ROUNDS:-2}"); do
      for ws in default "${CAP:-512}"; do
        opt=$([ $ws = default ] || echo "--backend-opt cudnn_workspace_mib=$ws")
        timeout 300 $LLMC bench train --backend cuda --dtype $dt --model $m $opt --steps 10 --warmup 3 --json \
          > "$OUT/run.json" 2> "$OUT/run.err" || { rc=1; tail -n 3 "$OUT/run.err"; continue; }
        $PY -c "import json,sys
r = json.load(open(sys.argv[1]))['results'][0]
print(f\"  workspace {sys.argv[2]}: {r['median_ms']:.1f} ms {r['tok_s'] / 1e3:.1f}k tok/s \"
      f\"{(r.get('device_used_bytes') or 0) / 2**30:.2f} GiB used loss {r['loss_last']:.4f}\")" "$OUT/run.json" $ws \
          | tee -a "$OUT/summary.log"
      done
    done
  done
done
if [ -n "${PROFILE:-}" ]; then
  set -- $PROFILE
  timeout 300 $PY "$HERE/backends/cuda/bench/cuda_profile.py" --model "$@" --steps 5 2>&1 | tail -n 60 \
    > "$OUT/profile.log"
  head -n 40 "$OUT/profile.log"
fi
exit $rc
