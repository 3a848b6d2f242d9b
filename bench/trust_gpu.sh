#!/usr/bin/env bash
# On the GPU machine: issue 16's checks in one call. Every backend's probe line, the kernel bench over cpu,
# OpenCL (NVIDIA's driver) and CUDA with the cpu backend as the reference (exit 0 = every kernel within its
# tolerance), and the reduction, kernel and CUDA tests over the GPU backends.
#   bash bench/trust_gpu.sh          (logs under $OUT or ./trust_out)
# Expects the cp312 wheels of pyopencl (+ pytools, platformdirs, siphash24), nvmath-python and
# nvidia-cudnn-frontend in .whl/ (carried), and NVIDIA's libnvidia-opencl.so.1.
set -u
OUT=${OUT:-$PWD/trust_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
LLMC_PACKAGES="-e . -e backends/cpu -e backends/cuda -e backends/opencl" source bench/carried_wheels.sh
mkdir -p /tmp/llmc_icd && echo libnvidia-opencl.so.1 > /tmp/llmc_icd/nvidia.icd
export OCL_ICD_VENDORS=/tmp/llmc_icd
rc=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|Vendor ID"
  llmc backends --json
} 2>&1 | tee "$OUT/env.log"
set -o pipefail
llmc bench kernels --backend cpu --backend opencl --backend cuda --model d12 -b 4 -t 1024 --repeat 5 \
  2>&1 | tee "$OUT/bench_kernels.log" || rc=1
llmc bench kernels --model d2 -b 2 -t 64 --repeat 2 --only global_norm 2>&1 | tee "$OUT/bench_default.log" || rc=1
$PY -m pytest -q -rs -p no:cacheprovider tests/contract/test_reductions.py backends/opencl/tests/test_opencl.py backends/cuda/tests/test_cuda.py \
  2>&1 | tail -n 40 | tee "$OUT/tests_gpu.log" || rc=1
$PY -m pytest -q -p no:cacheprovider -m "cuda or opencl" llmc_cli/testing/test_kernels.py tests/models/test_gpt2.py tests/models/test_llama3.py \
  2>&1 | tail -n 15 | tee "$OUT/tests_kernels.log" || rc=1
echo "trust_gpu: rc=$rc"
exit $rc
