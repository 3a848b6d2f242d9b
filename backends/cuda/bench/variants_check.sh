#!/usr/bin/env bash
# Kernel variants (issue 20) on the GPU machine: the CUDA variant tests, then `llmc bench kernels --variants` on
# GPT-2 d12 (B=8, T=1024) in bf16 and fp32, JSON and a summary under $OUT (or ./variants_out).
#   PART=tests bash backends/cuda/bench/variants_check.sh; then PART=bf16, then PART=fp32 (one call each: the cpu
#   reference of every d12 case at B=8 is most of a bench part's time)
#   tests  backends/cuda/tests/test_cuda_variants.py (every variant of every kernel against the default, the
#          default's launches, the bench's settled races) and the cuBLASLt / cuDNN tests of test_cuda.py
#   bf16   llmc bench kernels --backend cuda --dtype bf16 --variants --model d12 -b 8 -t 1024 --json
#   fp32   the same with --dtype fp32
# Expects python3.12 at /opt/torch/.venv (CuPy) and the carried cp312 wheels in .whl/ (nvmath-python,
# cudnn-frontend). Each part is bounded by `timeout`.
set -u
PART=${PART:-tests}
export OUT=${OUT:-$PWD/variants_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
summary() {  # per kernel: the default's median, the fastest (within the tolerance) and the variants' count
  $PY -c "import json,sys
d = json.load(open(sys.argv[1]))
for r in d['results']:
    vs = r.get('variants', [])
    best = next((v for v in vs if v['variant'] == r['fastest']), r)
    na = sum('skipped' in v for v in vs)
    print(f\"{r['kernel']:<28} {r['dtype']:<9} default {r['median_ms']:8.4f} ms [{r['min_ms']:.4f}-{r['max_ms']:.4f}]\",
          f\"fastest {r['fastest'] or 'none'} {best['median_ms']:8.4f} ms ({r['median_ms'] / best['median_ms']:.2f}x);\",
          f\"{len(vs)} variants, {na} n/a; err {r['max_rel_err'] if r['max_rel_err'] is None else format(r['max_rel_err'], '.1e')}\")
for m in d['mismatches']:
    print('MISMATCH', m)" "$1"
}
for part in $PART; do
cd "$HERE"
case "$part" in
tests)
  timeout 300 $PY -m pytest -q -s -p no:cacheprovider backends/cuda/tests/test_cuda_variants.py \
    backends/cuda/tests/test_cuda.py -k "variant or default_launches or races or tuner or cudnn or kernels" 2>&1 \
    | grep -E "variants ran|passed|failed|Error|error|assert" | tail -n 40 | tee "$OUT/tests.log"
  ;;
bf16|fp32)
  cd /tmp
  timeout 240 $LLMC bench kernels --backend cuda --dtype "$part" --variants --model d12 -b 8 -t 1024 --json \
    > "$OUT/variants_$part.json" 2> "$OUT/variants_$part.err" || { rc=1; tail -n 5 "$OUT/variants_$part.err"; }
  summary "$OUT/variants_$part.json" | tee "$OUT/variants_$part.log"
  ;;
esac
done
exit $rc
