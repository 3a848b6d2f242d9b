# Sourced by the device scripts here (fp8_check.sh, llama_check.sh): python3.12 with CuPy and torch (/opt/torch/.venv
# on the GPU machine), the carried cp312 wheels of .whl/ and this tree installed fresh under /tmp (a warm machine
# must not keep a previous call's code), the environment's line in $OUT/env.log. Sets PY, LLMC, HERE, rc.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PY:-/opt/torch/.venv/bin/python}
[ -x "$PY" ] || PY=python3
# (byte-compiled, as any pip install is: an image with PYTHONDONTWRITEBYTECODE would otherwise recompile every
# module on every start, a second and a half of the start-up time start_check.sh measures)
$PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/llmc
$PY -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/llmc . backends/cpu backends/opencl \
  backends/cuda 2>&1 | tail -2
export PYTHONPATH=/tmp/llmc:/tmp/site
HERE=$PWD
LLMC="$PY -m llmc_cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.log"
rc=0
