#!/usr/bin/env bash
# fp32 on the GPU: `llmc bench train` GPT-2 d12 B=16 T=1024 on the CUDA backend (TF32 matmuls, the default; and
# IEEE fp32 with --backend-opt tf32=off) and on the OpenCL backend (NVIDIA's driver), alternated ROUNDS times,
# medians in $OUT/fp32_summary.log. First the CUDA tests of the tiled attention and of TF32.
#   bash backends/cuda/bench/fp32_check.sh        (STEPS=5 WARMUP=2 ROUNDS=2 MODEL=d12 B=16 T=1024; TESTS=0 skips)
set -u
export OUT=${OUT:-$PWD/fp32_out}; mkdir -p "$OUT"
ICD_DIR=/tmp/llmc_icd; mkdir -p "$ICD_DIR"; echo "libnvidia-opencl.so.1" > "$ICD_DIR/nvidia.icd"
export OCL_ICD_VENDORS="$ICD_DIR"
. "$(dirname "$0")/device_setup.sh"
STEPS=${STEPS:-5}; WARMUP=${WARMUP:-2}; ROUNDS=${ROUNDS:-2}; MODEL=${MODEL:-d12}; B=${B:-16}; T=${T:-1024}
if [ "${TESTS:-1}" != 0 ]; then
  timeout 300 $PY -m pytest -q -p no:cacheprovider backends/cuda/tests/test_cuda.py -k "tiled or tf32 or fp32 or tuner" \
    2>&1 | tail -n 8 | tee "$OUT/tests.log"
fi
cd /tmp
for r in $(seq 1 "$ROUNDS"); do
  for run in cuda_tf32 cuda_ieee opencl; do
    case $run in
      cuda_tf32) args="--backend cuda" ;;
      cuda_ieee) args="--backend cuda --backend-opt tf32=off" ;;
      opencl) args="--backend opencl" ;;
    esac
    timeout 400 $LLMC bench train $args --dtype fp32 --model "$MODEL" -b "$B" -t "$T" --steps "$STEPS" \
      --warmup "$WARMUP" --json > "$OUT/${run}_$r.json" 2> "$OUT/${run}_$r.err" || { rc=1; tail -n 3 "$OUT/${run}_$r.err"; }
    $PY -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; print(sys.argv[2], 'round', sys.argv[3], \
round(r['median_ms'], 1), 'ms', round(r['tok_s']), 'tok/s', r.get('dtype'))" "$OUT/${run}_$r.json" "$run" "$r" \
      2>/dev/null | tee -a "$OUT/fp32_summary.log"
  done
done
exit $rc
