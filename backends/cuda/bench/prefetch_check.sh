#!/usr/bin/env bash
# Training data read ahead by a thread and copied on a side stream (issue 20) on the GPU machine, one call (logs
# under $OUT or ./prefetch_out):
#   1. the CUDA tests of it (the input queue under a held-up compute stream; d2, llama3-tiny and fp32 d2 trained
#      with and without prefetch, bit for bit) and the kit's input_queue case on cuda
#   2. `llmc bench train` GPT-2 d12 bf16 T=1024 at B=8 and B=64, --prefetch then --no-prefetch, ROUNDS times
#      (default 1), one process each; one summary line per run in $OUT/train_summary.log
#   bash backends/cuda/bench/prefetch_check.sh          (a second call with PART=train ROUNDS=2 repeats only 2.)
# Expects python3.12 at /opt/torch/.venv (CuPy, torch) and the carried cp312 wheels in .whl/ (nvmath-python,
# cudnn-frontend).
set -u
export OUT=${OUT:-$PWD/prefetch_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
cd "$HERE"
if [ "${PART:-all}" != train ]; then
timeout 200 $PY -m pytest -q -s -p no:cacheprovider backends/cuda/tests/test_cuda.py -k "input_queue or prefetched" \
  2>&1 | tail -n 12 | tee "$OUT/tests_cuda.log"
grep -q " passed" "$OUT/tests_cuda.log" && ! grep -qE "failed|error" "$OUT/tests_cuda.log" || rc=1
LLMC_TEST_BACKENDS=cuda timeout 120 $PY -m pytest -q -p no:cacheprovider --pyargs llmc_cli.testing -k input_queue \
  2>&1 | tail -n 3 | tee "$OUT/tests_kit.log"
grep -q " passed" "$OUT/tests_kit.log" && ! grep -qE "failed|error" "$OUT/tests_kit.log" || rc=1
fi
cd /tmp
for round in $(seq "${ROUNDS:-1}"); do
  for B in 8 64; do
    for pf in prefetch no-prefetch; do
      # warm-up past GRAPH_AFTER (6): the timed steps replay captured graphs
      timeout 120 $LLMC bench train --backend cuda --dtype bf16 --model d12 -b $B -t 1024 --steps "${STEPS:-30}" \
        --warmup 8 --$pf --json > "$OUT/train_b${B}_${pf}_$round.json" 2> "$OUT/train_b${B}_${pf}_$round.err" || rc=1
      $PY -c "import json,sys
try: r = json.load(open(sys.argv[1]))['results'][0]
except Exception as e: print(sys.argv[1].rsplit('/', 1)[1], 'unreadable', e); sys.exit()
print(sys.argv[1].rsplit('/', 1)[1], f\"{r['median_ms']:.2f} ms [{r['min_ms']:.2f}-{r['max_ms']:.2f}]\",
      f\"{r['tok_s'] / 1e3:.1f}k tok/s\", f\"waits {r['data_waits']}/{r['data_batches']} ({r['data_wait_ms']:.2f} ms)\",
      f\"loss {r['loss_first']:.6f} -> {r['loss_last']:.6f}\")" "$OUT/train_b${B}_${pf}_$round.json" \
        | tee -a "$OUT/train_summary.log"
      [ -s "$OUT/train_b${B}_${pf}_$round.json" ] || tail -n 3 "$OUT/train_b${B}_${pf}_$round.err"
    done
  done
done
exit $rc
