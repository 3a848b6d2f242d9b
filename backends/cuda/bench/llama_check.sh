#!/usr/bin/env bash
# The Llama-at-scale issue's measurements on the GPU machine, one call per part (logs under $OUT or ./llama_out):
#   PART=tests bash backends/cuda/bench/llama_check.sh    the CUDA tests (those of two GPUs where two are here)
#   PART=decode bash backends/cuda/bench/llama_check.sh   the CUDA tests, then `llmc bench decode` on CUDA (bf16) and
#                                                         OpenCL (NVIDIA's driver, fp32), GPT-2 d12 and Llama 3.2-1B
#   PART=1b     ...   Llama 3.2-1B B=8 T=2048 bf16: --dry-run's plan, then llmc vs PyTorch (eager, torch.compile)
#                     through `llmc bench train --compare torch`
#   PART=profile ...  where a decoded token's time goes (decode_profile.py), d12 and Llama 3.2-1B
#   PART=norm   ...   the CUDA norm tests, then the norm backward's implementations (`llmc bench kernels --variants`)
#                     on Llama 3.2-1B's (B=8 T=2048) and Llama 3.1 8B's (B=1 T=8192) shapes
#   PART=8b     ...   Llama 3.1 8B on every GPU here (GPUS=N: the first N; GPUS="2 4" ROUNDS=2 alternates the
#                     counts): CONFIGS="BxT:recompute ..." tried in order until one trains (ZERO, STEPS, DTYPE, EXTRA
#                     train options, TAG for the log names from the environment); device memory sampled by
#                     nvidia-smi; each rank's step phases in $OUT/phases_<run>, summed up in $OUT/8b_phases.log
# Expects python3.12 at /opt/torch/.venv (CuPy, torch), the carried cp312 wheels in .whl/ (pyopencl and its
# dependencies, nvmath-python, cudnn-frontend), NVIDIA's driver with libnvidia-opencl.so.1.
set -u
PART=${PART:-decode}  # several parts: PART="1b profile"
export OUT=${OUT:-$PWD/llama_out}; mkdir -p "$OUT"
ICD_DIR=/tmp/llmc_icd; mkdir -p "$ICD_DIR"; echo "libnvidia-opencl.so.1" > "$ICD_DIR/nvidia.icd"
export OCL_ICD_VENDORS="$ICD_DIR"
. "$(dirname "$0")/device_setup.sh"
for part in $PART; do
cd "$HERE"
case "$part" in
profile)
  (cd /tmp && timeout 200 $PY "$HERE/backends/cuda/bench/decode_profile.py" d12 1024) 2>&1 | tail -n 30 | tee "$OUT/profile_d12.log"
  (cd /tmp && timeout 200 $PY "$HERE/backends/cuda/bench/decode_profile.py" llama3.2-1b 2048) 2>&1 | tail -n 30 \
    | tee "$OUT/profile_1b.log"
  ;;
tests)
  timeout 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests backends/cuda/tests 2>&1 | tail -n 15 \
    | tee "$OUT/tests_cuda.log"
  ;;
decode)
  timeout 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests backends/cuda/tests 2>&1 | tail -n 15 \
    | tee "$OUT/tests_cuda.log"
  cd /tmp
  for be in cuda opencl; do
    dt=$([ $be = cuda ] && echo bf16 || echo fp32)
    timeout 200 $LLMC bench decode --backend $be --dtype $dt --model d12 -t 1024 --json > "$OUT/decode_d12_$be.json" \
      2> "$OUT/decode_d12_$be.err" || rc=1
    timeout 300 $LLMC bench decode --backend $be --dtype $dt --model llama3.2-1b -t 2048 --tokens 256 --json \
      > "$OUT/decode_1b_$be.json" 2> "$OUT/decode_1b_$be.err" || rc=1
  done
  for f in "$OUT"/decode_*.json; do
    $PY -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; print(sys.argv[1].rsplit('/',1)[1], \
{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != 'device'})" "$f" || tail -n 3 "${f%.json}.err"
  done | tee "$OUT/decode_summary.log"
  ;;
norm)
  timeout 300 $PY -m pytest -q -m cuda -p no:cacheprovider -k "norm" tests/contract backends/cuda/tests 2>&1 \
    | tail -n 8 | tee "$OUT/tests_norm.log"
  cd /tmp
  for shape in "llama3.2-1b -b 8 -t 2048" "llama3.1-8b -b 1 -t 8192"; do
    timeout 200 $LLMC bench kernels --backend cuda --dtype bf16 --variants --only rmsnorm_bwd --model $shape \
      --repeat 20 2>&1 | tail -n 30 | tee -a "$OUT/norm_variants.log"
  done
  ;;
1b)
  for ws in ${CUDNN_WS:-default}; do  # cuDNN's attention-backward workspace cap (MiB, or the backend's default);
    # several values: one profile each
    (cd /tmp && [ "$ws" = default ] || export LLMC_CUDNN_WORKSPACE_MIB=$ws
     timeout 300 $PY "$HERE/backends/cuda/bench/cuda_profile.py" \
      --model llama3.2-1b -b 8 -t 2048 --steps 5 --json "$OUT/1b_profile_ws$ws.json") 2>&1 | tail -n 60 \
      > "$OUT/1b_profile_ws$ws.log"
    echo "workspace $ws MiB: $(grep END2END "$OUT/1b_profile_ws$ws.log")"
    grep -E "^(attention_backward|rmsnorm_backward|swiglu|rope)" "$OUT/1b_profile_ws$ws.log"
  done
  [ -n "${PROFILE_ONLY:-}" ] && continue
  cd /tmp
  timeout 60 $LLMC train --backend cuda --dtype bf16 --model llama3.2-1b -b 8 -t 2048 --recompute gelu --dry-run 2>&1 \
    | tail -n 20 | tee "$OUT/1b_dry_run_recompute.log"
  A="--backend cuda --dtype bf16 --model llama3.2-1b -b 8 -t 2048"
  timeout 60 $LLMC train $A --dry-run 2>&1 | tail -n 20 | tee "$OUT/1b_dry_run.log"
  timeout 500 $LLMC bench train $A --steps "${STEPS:-10}" --warmup 3 --compare torch --torch-dtype bf16 --json \
    > "$OUT/1b_bench_train.json" 2> "$OUT/1b_bench_train.err" || rc=1
  tail -n 5 "$OUT/1b_bench_train.err"
  ;;
8b)
  # CONFIGS: B x T : recompute, tried in order until one trains (the first that fits is the fastest); GPUS="2 4"
  # and ROUNDS=2 alternate the GPU counts round by round; the step phases of each run go to $OUT/phases_<tag>
  cd /tmp
  $PY -c "import numpy as np; from llmc_cli.formats.shards import write_shard; \
write_shard('/tmp/l3_train_000.bin', np.random.default_rng(0).integers(0, 128256, 4_000_000), tokenizer='llama3')"
  for round in $(seq "${ROUNDS:-1}"); do
  for NG in ${GPUS:-$(nvidia-smi -L | wc -l)}; do
  for cfg in ${CONFIGS:-1x8192:none 1x8192:gelu 1x8192:gelu+layernorm}; do
    B=${cfg%%x*}; rest=${cfg#*x}; T=${rest%%:*}; R=${cfg#*:}
    tag="8b_g${NG}_b${B}_t${T}_${R/+/_}_z${ZERO:-1}_${DTYPE:-bf16}${TAG:-}_r$round"
    A="--backend cuda --dtype ${DTYPE:-bf16} --model llama3.1-8b -b $B -t $T --zero ${ZERO:-1} --recompute $R"
    A="$A ${EXTRA:-}"
    [ "$round" = 1 ] && timeout 60 $LLMC train $A --gpus "$NG" --dry-run 2>&1 | tail -n 12 > "$OUT/${tag}_dry_run.log"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/${tag}_mem.csv" &
    SMI=$!
    LLMC_STEP_PHASES="$OUT/phases_$tag" timeout "${T8B:-420}" $LLMC train $A --gpus "$NG" --steps "${STEPS:-10}" \
      --val-every 0 --sample-every 0 --data "/tmp/l3_train_*.bin" > "$OUT/${tag}_train.log" 2>&1; code=$?
    kill $SMI
    tail -n 2 "$OUT/${tag}_train.log"
    echo "$tag: exit $code; planned $(grep -sE 'total' "$OUT/${tag}_dry_run.log" | tr -s ' ' | head -1); device \
peak $(sort -t, -k2 -n "$OUT/${tag}_mem.csv" | tail -1) MiB" | tee -a "$OUT/8b_summary.log"
    $PY "$HERE/bench/train_median.py" --skip 3 "$OUT/${tag}_train.log" | tee -a "$OUT/8b_summary.log"
    [ $code = 0 ] && break
  done
  done
  done
  $PY "$HERE/bench/step_phases.py" --skip "${PHASE_SKIP:-5}" "$OUT"/phases_* | tee "$OUT/8b_phases.log"
  ;;
esac
done
exit $rc
