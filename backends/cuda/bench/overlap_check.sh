#!/usr/bin/env bash
# `llmc bench overlap` on the GPU machine: the rewrite diary's copy/compute overlap experiment (issue 20).
#   bash backends/cuda/bench/overlap_check.sh            (results under $OUT or ./overlap_out)
# PART (default "tests sweep blocks"; "opencl" is a second call), each part under its own time limit:
#   tests   the CUDA backend's overlap tests (backends/cuda/tests/test_cuda_overlap.py) and the engine's
#   sweep   B 8..512, T=1024, C=768: sync and chunked over 1 2 4 8 16 streams, block 256, pinned and pageable
#           -> sweep.json, sweep.png, sweep.txt (the table and the summary lines)
#   blocks  every block size 32..1024, pinned, B 8 64 512, both modes -> blocks.json, blocks.png, blocks.txt
#   opencl  the sweep's B 64 and 512 on the OpenCL backend over NVIDIA's OpenCL driver (its ICD registered by hand,
#           as backends/opencl/bench/opencl_gpu.sh does), where pyopencl is carried and the driver loads
# Expects python3.12 at /opt/torch/.venv (CuPy), the carried cp312 wheels in .whl/ (nvmath-python, cudnn-frontend;
# pyopencl and its dependencies for PART=opencl). REPEAT (default 3) and WARMUP (1) per case.
set -u
PART=${PART:-tests sweep blocks}
export OUT=${OUT:-$PWD/overlap_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
REPEAT=${REPEAT:-3}; WARMUP=${WARMUP:-1}
PLOT=1; $PY -c "import matplotlib" 2>/dev/null || { PLOT=0; echo "matplotlib missing: no PNGs" | tee -a "$OUT/env.log"; }

bench() {  # NAME ARGS...: one `llmc bench overlap` run -> NAME.json (+ NAME.png), then NAME.txt drawn from the JSON
  local name=$1; shift
  local plot=(); [ $PLOT = 1 ] && plot=(--plot "$OUT/$name.png")
  (cd /tmp && timeout "${LIMIT:-150}" $LLMC bench overlap "$@" --repeat "$REPEAT" --warmup "$WARMUP" "${plot[@]}" \
    --json > "$OUT/$name.json" 2> "$OUT/$name.err") || { rc=1; tail -n 3 "$OUT/$name.err"; }
  $PY - "$OUT/$name.json" <<'PYEOF' 2>&1 | tee "$OUT/$name.txt"
import json, sys
from rich.console import Console
from llmc_cli.bench.machine import machine_lines
from llmc_cli.bench.report import overlap_lines, overlap_table
res = json.load(open(sys.argv[1]))
con = Console(width=250)
for line in machine_lines(res["machine"]) + [f"not benchmarked: {s['backend']} ({s['reason']})" for s in res["skipped"]]:
    print(line)
con.print(overlap_table(res))
for line in overlap_lines(res):
    print(line)
print(f"{len(res['results'])} cases, {len(res['mismatches'])} mismatches")
PYEOF
}

for part in $PART; do
cd "$HERE"
case "$part" in
tests)
  timeout 200 $PY -m pytest -q -p no:cacheprovider -rs backends/cuda/tests/test_cuda_overlap.py tests/bench/test_overlap.py \
    tests/commands/test_overlap_cli.py > "$OUT/tests.log" 2>&1 || rc=1
  tail -n 15 "$OUT/tests.log"
  ;;
sweep)
  bench sweep --backend cuda --grid full --block 256
  ;;
blocks)
  bench blocks --backend cuda --grid full --host-memory pinned -b 8 -b 64 -b 512
  ;;
opencl)
  ICD_DIR=/tmp/llmc_icd; mkdir -p "$ICD_DIR"
  echo "libnvidia-opencl.so.1" > "$ICD_DIR/nvidia.icd"
  export OCL_ICD_VENDORS="$ICD_DIR"
  (cd /tmp && $LLMC backends --json) > "$OUT/opencl_backends.json" 2>&1
  if $PY -c "import json, sys; sys.exit(not any(b['name'] == 'opencl' and b['usable'] for b in json.load(sys.stdin)))" \
      < "$OUT/opencl_backends.json" 2>/dev/null; then
    LIMIT=100 bench opencl --backend opencl --grid full --backend-opt tune=off -b 64 -b 512 --block 256
    timeout 100 $PY -m pytest -q -p no:cacheprovider backends/opencl/tests/test_opencl_overlap.py \
      > "$OUT/opencl_tests.log" 2>&1 || rc=1
    tail -n 5 "$OUT/opencl_tests.log"
  else
    echo "opencl: pyopencl or NVIDIA's OpenCL driver not usable here (see opencl_backends.json); skipped" \
      | tee "$OUT/opencl_skipped.log"
  fi
  ;;
esac
done
exit $rc
