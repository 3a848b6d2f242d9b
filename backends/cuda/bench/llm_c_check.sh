#!/usr/bin/env bash
# llmc against llm.c on the same tokenized text and GPUs, in one call: llm.c's train_gpt2cu is built here (cuDNN
# attention, MPI and NCCL for several GPUs), then the two train the same GPT-2 from scratch, runs alternated.
#   carry [".whl", ".llm.c", "datasets/shakespeare"]; bash backends/cuda/bench/llm_c_check.sh
# .llm.c/ is karpathy/llm.c's source (`git archive HEAD Makefile train_gpt2.cu llmc dev/unistd.h`);
# datasets/shakespeare is `llmc tokenize shakespeare` (llm.c's shard format). Never random tokens: llm.c's encoder
# backward slows with the number of distinct tokens in a batch.
# From the environment: MODEL (d12), B (64 a GPU), T (1024), GPUS (1), STEPS (40), ROUNDS (2), RECOMPUTE (none, or
# gelu: llm.c's -r 1), ZERO (1; llm.c's -z), VARIANT (one backend option, e.g. "p2p=on": an extra llmc run
# a round). Per run: median ms of the steps after the fifth, tok/s, and the peak
# device memory nvidia-smi saw on GPU 0; logs under $OUT (or ./llm_c_out).
set -u
export OUT=${OUT:-$PWD/llm_c_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
MODEL=${MODEL:-d12}; B=${B:-64}; T=${T:-1024}; GPUS=${GPUS:-1}; STEPS=${STEPS:-40}; ROUNDS=${ROUNDS:-2}
RECOMPUTE=${RECOMPUTE:-none}; ZERO=${ZERO:-1}
TRAIN="$HERE/datasets/shakespeare/*train*.bin"; VAL="$HERE/datasets/shakespeare/*val*.bin"
[ -f "$HERE/.llm.c/train_gpt2.cu" ] || { echo "llm_c_check: no .llm.c/ (llm.c's source) was carried"; exit 2; }
# cudnn-frontend's headers come from the carried wheel (the same version llmc's cuDNN attention uses), where
# llm.c's Makefile looks for them
rm -rf /tmp/llm.c /tmp/cfe && cp -r "$HERE/.llm.c" /tmp/llm.c && mkdir -p /tmp/cfe
(cd /tmp/cfe && $PY -m zipfile -e "$HERE"/.whl/nvidia_cudnn_frontend-*.whl .) && mkdir -p /tmp/llm.c/cudnn-frontend \
  && mv /tmp/cfe/include /tmp/llm.c/cudnn-frontend/include
# CUDA 13's cudaMemAdvise takes a cudaMemLocation (llm.c's managed-memory fallback, unused when the GPU has room)
CUDA_MAJOR=$(nvcc --version 2>/dev/null | sed -nE 's/.*release ([0-9]+)\..*/\1/p')
HOST='cudaMemLocation{cudaMemLocationTypeHost, 0}'
[ "${CUDA_MAJOR:-0}" -ge 13 ] && sed -i "s/cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)/cudaMemAdviseSetPreferredLocation, $HOST)/" \
  /tmp/llm.c/llmc/cuda_utils.cuh
# cudnn-frontend 1.32's headers compile NVRTC programs of their own: link NVRTC and the driver too
sed -i 's/^NVCC_LDLIBS =$/NVCC_LDLIBS = -lnvrtc -lcuda/' /tmp/llm.c/Makefile
(cd /tmp/llm.c && time make train_gpt2cu USE_CUDNN=1) > "$OUT/build.log" 2>&1 \
  || { echo "llm_c_check: llm.c did not build"; tail -n 20 "$OUT/build.log"; exit 1; }
grep -E "^real|MPI|NCCL|cuDNN" "$OUT/build.log" | head -n 6
peak() {  # peak MiB on GPU 0 while "$@" runs
  nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/mem.csv" &
  local smi=$!
  "$@"; local code=$?
  kill $smi; sort -n "$OUT/mem.csv" | tail -n 1 > "$OUT/peak"
  return $code
}
llm_c() {  # round
  local r=$([ "$RECOMPUTE" = none ] && echo 0 || echo 1)
  local args=(-i "$TRAIN" -j "$VAL" -e "$MODEL" -b "$B" -t "$T" -d $((B * T * GPUS)) -x "$STEPS" -v 100000 -s 100000
              -r "$r" -z "$ZERO" -h 0)
  if [ "$GPUS" -gt 1 ]; then
    (cd /tmp/llm.c && peak timeout 600 mpirun --allow-run-as-root -np "$GPUS" ./train_gpt2cu "${args[@]}")
  else
    (cd /tmp/llm.c && peak timeout 600 ./train_gpt2cu "${args[@]}")
  fi > "$OUT/llm_c_$1.log" 2>&1 || { rc=1; echo "llm.c round $1 failed"; tail -n 5 "$OUT/llm_c_$1.log"; }
  echo "llm.c round $1: $(sed -nE 's/^step +([0-9]+)\/[0-9]+ .*\| ([0-9.]+) ms \|.*/\1 \2/p' "$OUT/llm_c_$1.log" \
    | summary) peak $(cat "$OUT/peak") MiB" | tee -a "$OUT/summary.log"
}
llmc() {  # round [backend option]
  local tag=${2:-}; tag=${tag//=/_}  # (file names without "=")
  (cd /tmp && peak timeout 600 $LLMC train ${2:+--backend-opt "$2"} --backend cuda --dtype bf16 \
    --model "$MODEL" -b "$B" -t "$T" \
    --gpus "$GPUS" --zero "$ZERO" --recompute "$RECOMPUTE" --steps "$STEPS" --data "$TRAIN" --val-every 0 \
    --sample-every 0 --log "$OUT/llmc_$1$tag.jsonl") > "$OUT/llmc_$1$tag.log" 2>&1 \
    || { rc=1; echo "llmc round $1 failed"; tail -n 5 "$OUT/llmc_$1$tag.log"; }
  echo "llmc ${2:-} round $1: $($PY -c "import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if 'ms' in r and 'step' in r: print(r['step'], r['ms'])" "$OUT/llmc_$1$tag.jsonl" | summary) \
peak $(cat "$OUT/peak") MiB" \
    | tee -a "$OUT/summary.log"
}
summary() {  # "step ms" lines -> the median ms after step 5 and tok/s
  $PY -c "import statistics, sys
ms = [float(l.split()[1]) for l in sys.stdin if l.split() and int(l.split()[0]) > 5]
m = statistics.median(ms) if ms else float('nan')
print(f'median {m:.1f} ms over {len(ms)} steps, {$B * $T * $GPUS / m * 1e3:,.0f} tok/s')"
}
echo "$MODEL B=$B T=$T on $GPUS GPU(s), --recompute $RECOMPUTE, ZeRO-$ZERO, $STEPS steps" | tee "$OUT/summary.log"
for r in $(seq "$ROUNDS"); do  # alternated: llm.c first in odd rounds, llmc first in even ones
  if [ $((r % 2)) = 1 ]; then llm_c "$r"; llmc "$r"; else llmc "$r"; llm_c "$r"; fi
  [ -n "${VARIANT:-}" ] && llmc "$r" "$VARIANT"
done
exit $rc
