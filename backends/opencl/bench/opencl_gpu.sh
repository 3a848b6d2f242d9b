#!/usr/bin/env bash
# On an NVIDIA GPU machine: llmc's OpenCL SGEMM against cuBLAS fp32 (CuPy, TF32 off).
#   bash backends/opencl/bench/opencl_gpu.sh            (results under $OUT or ./opencl_gpu_out)
# Expects: python3.12 at /opt/torch/.venv (CuPy installed), the pyopencl wheel (cp312 manylinux) in .whl/
# (carried), NVIDIA's driver with libnvidia-opencl.so.1 (registered here through OCL_ICD_VENDORS).
# Shapes are M x K x N of C (M,N) = A (M,K) @ W (N,K)^T, the forward matmul layout (NT):
#   65536x768x3072 (GPT-2 d12 fc, B*T=64k), 256x768x50304 (classifier), 4096x4096x4096.
# The dinp (NN) and dweight (TN) layouts are timed too. Then d12 B=16 T=1024 fp32 training, OpenCL vs CUDA backend
# (TRAIN=0 skips, TRAIN_BACKENDS picks, STEPS=5), and the OpenCL tests on the GPU device (TESTS=0 skips).
# All wheels in .whl/ are installed with --no-deps (pyopencl pytools platformdirs siphash24, and the CUDA
# backend's nvmath-python + nvidia-cudnn-frontend). ~110 s of run time on an H100.
set -u
export OUT=${OUT:-$PWD/opencl_gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
WHL=${WHL_DIR:-.whl}

# NVIDIA's OpenCL ICD, registered by hand
ICD_DIR=${ICD_DIR:-/tmp/llmc_icd}
mkdir -p "$ICD_DIR"
echo "libnvidia-opencl.so.1" > "$ICD_DIR/nvidia.icd"
export OCL_ICD_VENDORS="$ICD_DIR"

# carried wheels (pyopencl, pytools, platformdirs, siphash24; nvmath-python + cudnn-frontend for the CUDA backend)
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_ocl \
    "$WHL"/*.whl 2>&1 | tail -3 || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site_ocl${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-deps --no-build-isolation --no-compile -e . -e backends/cpu -e backends/opencl \
  -e backends/cuda 2>&1 | tail -2

# tune from scratch on this GPU, cache kept with the results
export LLMC_OPENCL_TUNE_CACHE="$OUT/opencl_tune.json"
export LLMC_OPENCL_TUNE=force
export CUPY_TF32=0 NVIDIA_TF32_OVERRIDE=0

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import pyopencl as cl; print('pyopencl', cl.VERSION_TEXT); [print(' ', p.name, '|', d.name, '|', d.version) for p in cl.get_platforms() for d in p.get_devices()]"
} 2>&1 | tee "$OUT/env.log"

$PY - <<'PYEOF' 2>&1 | tee "$OUT/sgemm.log"
import json, os, time
import numpy as np
import pyopencl as cl
import pyopencl.array as cla
from llmc_opencl import OpenCLPlugin, tune

be = OpenCLPlugin().create(device=os.environ.get("LLMC_OPENCL_DEVICE", "gpu"))
os.environ["LLMC_OPENCL_TUNE"] = "1"
print(be.describe(), flush=True)

SHAPES = [(65536, 768, 3072), (256, 768, 50304), (4096, 4096, 4096)]  # M, K, N
REPS = 10
results = {"device": be.describe(), "tune": {k: v for k, v in be.gemm_config.items()}, "shapes": []}


def time_ocl(layout, M, K, N):
    a_t, b_t = int(layout[0] == "T"), int(layout[1] == "T")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((K, M) if a_t else (M, K), dtype=np.float32)
    b = rng.standard_normal((N, K) if b_t else (K, N), dtype=np.float32)
    A, B = cla.to_device(be.queue, a), cla.to_device(be.queue, b)
    C = cla.empty(be.queue, (M, N), np.float32)
    run = lambda: be.gemm(a_t, b_t, M, N, K, A.data, 0, M if a_t else K, B.data, 0, K if b_t else N,  # noqa
                          C.data, 0, N)
    run(); be.queue.finish()
    # correctness spot check on a few rows against float64
    rows = np.arange(0, M, max(1, M // 7))[:8]
    ref = (a.T if a_t else a)[rows].astype(np.float64) @ (b.T if b_t else b).astype(np.float64)
    err = np.linalg.norm(C.get()[rows] - ref) / np.linalg.norm(ref)
    t0 = time.perf_counter()
    for _ in range(REPS):
        run()
    be.queue.finish()
    dt = (time.perf_counter() - t0) / REPS
    del A, B, C
    return 2.0 * M * N * K / dt / 1e12, err


def time_cublas(layout, M, K, N):
    import cupy as cp
    a_t, b_t = layout[0] == "T", layout[1] == "T"
    a = cp.random.standard_normal((K, M) if a_t else (M, K), dtype=cp.float32)
    b = cp.random.standard_normal((N, K) if b_t else (K, N), dtype=cp.float32)
    opa, opb = (a.T if a_t else a), (b.T if b_t else b)
    c = cp.matmul(opa, opb)
    cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(REPS):
        cp.matmul(opa, opb, out=c)
    e.record(); e.synchronize()
    dt = cp.cuda.get_elapsed_time(s, e) / 1e3 / REPS
    del a, b, c
    cp.get_default_memory_pool().free_all_blocks()
    return 2.0 * M * N * K / dt / 1e12


for (M, K, N) in SHAPES:
    for layout in ("NT", "NN", "TN"):
        # the same product in the three layouts the backend uses (forward, dinp, dweight)
        ours, err = time_ocl(layout, M, K, N)
        try:
            cub = time_cublas(layout, M, K, N)
        except Exception as ex:  # CuPy missing or out of memory
            cub = float("nan")
            print("cupy:", type(ex).__name__, ex)
        row = dict(M=M, K=K, N=N, layout=layout, opencl_tflops=round(ours, 3), cublas_fp32_tflops=round(cub, 3),
                   ratio=round(ours / cub, 3) if cub == cub else None, rel_err=float(err))
        results["shapes"].append(row)
        print(f"{M}x{K}x{N} {layout}: llmc OpenCL {ours:7.2f} TFLOP/s   cuBLAS fp32 {cub:7.2f} TFLOP/s   "
              f"ratio {row['ratio']}   rel err {err:.1e}", flush=True)

json.dump(results, open(os.path.join(os.environ.get("OUT", "."), "sgemm.json"), "w"), indent=1)
PYEOF
rc=${PIPESTATUS[0]}

export LLMC_OPENCL_TUNE=1  # training reuses the tuned configuration cached above
# d12 B=16 T=1024 fp32 training throughput: OpenCL backend vs CUDA backend (fp32), synthetic token shard
if [ "${TRAIN:-1}" = 1 ]; then
  mkdir -p /tmp/llmc_data
  $PY -c "
import numpy as np
from llmc_cli.formats.shards import write_shard
write_shard('/tmp/llmc_data/synth_train_000.bin', np.random.default_rng(0).integers(0, 50257, 2_000_000).astype(np.uint16))"
  for be in ${TRAIN_BACKENDS:-opencl cuda}; do
    timeout ${TRAIN_TIMEOUT:-150} llmc train --backend $be --dtype fp32 --model d12 -b 16 -t 1024 --steps ${STEPS:-5} \
      --data '/tmp/llmc_data/synth_train_*.bin' --val-every 0 --sample-every 0 2>&1 | tee "$OUT/train_d12_$be.log" | tail -n 12
  done
fi

# the OpenCL tests on the GPU device (conformance against the cpu backend, engine, OpenCL-specific)
if [ "${TESTS:-1}" = 1 ]; then
  export LLMC_OPENCL_TUNE=1
  $PY -m pytest -q -x -k "opencl" llmc_cli/testing/test_kernels.py backends/opencl/tests/test_opencl.py \
    --junitxml="$OUT/test_opencl.xml" 2>&1 | tail -n 20 | tee "$OUT/test_opencl.log"
fi
exit $rc
