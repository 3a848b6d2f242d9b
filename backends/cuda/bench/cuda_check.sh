#!/usr/bin/env bash
# One call on the GPU machine: install what it lacks, run the CUDA tests and a timed GPT-2 d12 training run.
#   bash backends/cuda/bench/cuda_check.sh [quick|tests|train|all]   (default all; logs and junit xml under $OUT or ./cuda_out)
# Expects the wheels of nvmath-python and nvidia-cudnn-frontend (cp312 manylinux) in .whl/ (carried).
set -u
OUT=${OUT:-$PWD/cuda_out}; mkdir -p "$OUT"
MODE=${1:-all}
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
# carried wheels, then the repo's packages (engine, cpu reference, cuda backend)
source bench/carried_wheels.sh
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import cupy, nvmath, cudnn; print('cupy', cupy.__version__, 'nvmath', nvmath.__version__, 'cudnn-frontend', cudnn.__version__, 'cudnn', cudnn.backend_version())"
  llmc backends
} 2>&1 | tee "$OUT/env.log"

rc=0
if [ "$MODE" = quick ]; then
  $PY -m pytest -x -q backends/cuda/tests/test_cuda.py -s -k "probe or nvrtc or fp32_kernels or cudnn" 2>&1 | tee "$OUT/quick.log"
  exit ${PIPESTATUS[0]}
fi
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  set -o pipefail
  $PY -m pytest -q -rs backends/cuda/tests/test_cuda.py -s --junitxml="$OUT/test_cuda.xml" 2>&1 | tee "$OUT/test_cuda.log" || rc=1
  $PY -m pytest -q -k "cuda" llmc_cli/testing/test_kernels.py tests/models/test_gpt2.py tests/models/test_llama3.py --junitxml="$OUT/test_kernels.xml" 2>&1 \
    | tail -n 60 | tee "$OUT/test_kernels.log" || rc=1
  set +o pipefail
fi
if [ "$MODE" = all ] || [ "$MODE" = train ]; then
  # synthetic GPT-2 token shard (llm.c format) so the run needs no dataset download
  mkdir -p /tmp/llmc_data
  $PY - <<'PYEOF'
import numpy as np
from llmc_cli.formats.shards import write_shard
rng = np.random.default_rng(0)
write_shard("/tmp/llmc_data/synth_train_000.bin", rng.integers(0, 50257, 4_000_000).astype(np.uint16))
PYEOF
  # twice: the first run compiles the kernels (cold NVRTC cache on a fresh machine), the second loads them from
  # the disk cache; each line is stamped with the seconds since `llmc train` started (time to first step)
  for run in cold warm; do
    START=$(date +%s.%N)
    timeout 300 llmc train --backend cuda --dtype bf16 --model d12 -b 64 -t 1024 --steps ${STEPS:-20} \
      --data '/tmp/llmc_data/synth_train_*.bin' --val-every 0 --sample-every 0 2>&1 \
      | $PY -u -c "import sys,time; t0=float(sys.argv[1]); [print(f'[{time.time()-t0:6.1f}s] '+l, end='') for l in sys.stdin]" $START \
      | tee "$OUT/train_d12_$run.log" || rc=1
  done
fi
exit $rc
