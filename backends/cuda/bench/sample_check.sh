#!/usr/bin/env bash
# `llmc sample --max-new-tokens 1000` as users see it, on the GPU machine: the tokens/s the command reports for
# GPT-2 d12 and Llama 3.2-1B (random weights in bf16, sample_models.py), each at the defaults twice (the first
# run fills the kernel cache), greedy and with --top-k 40; then where a token's time goes (sample_profile.py,
# decode_profile.py). Logs under $OUT or ./sample_out.
#   bash backends/cuda/bench/sample_check.sh
# MODELS (d12 llama3.2-1b), TOKENS (1000) from the environment. BASE=DIR: the same runs first on the llmc tree in
# DIR (another version), and the text each run printed compared with this tree's (the same seed, the same text).
# RUNS: which runs (defaults defaults2 greedy topk40). BASE_MODELS: the models run on BASE (MODELS). PROFILE=0
# skips the profile of a token (sample_profile.py), DECODE_PROFILE=1 adds decode_profile.py's calls.
# GPT2_RANKS=FILE: GPT-2's gpt2.tiktoken, put where llmc looks for it when the machine has none. Everything ends up
# in $OUT/sample_logs.tgz as well.
set -u
export OUT=${OUT:-$PWD/sample_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
MODELS=${MODELS:-d12 llama3.2-1b}; TOKENS=${TOKENS:-1000}; CK=/tmp/llmc_sample
if [ -n "${GPT2_RANKS:-}" ]; then
  d=$($PY -c "from llmc_cli.data.home import packages_dir; print(packages_dir())")/whisper/assets
  mkdir -p "$d" && { [ -f "$d/gpt2.tiktoken" ] || cp "$GPT2_RANKS" "$d/gpt2.tiktoken"; }
fi
cd /tmp
timeout 300 $PY "$HERE/backends/cuda/bench/sample_models.py" $CK $MODELS || exit 1
trees="new"
if [ -n "${BASE:-}" ]; then
  rm -rf /tmp/llmc_base
  $PY -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/llmc_base "$HERE/$BASE" \
    "$HERE/$BASE/backends/cpu" "$HERE/$BASE/backends/cuda" 2>&1 | tail -2
  trees="base new"
fi
for tree in $trees; do
  path=$([ $tree = base ] && echo /tmp/llmc_base:/tmp/site || echo /tmp/llmc:/tmp/site)
  for m in $MODELS; do
    for run in ${RUNS:-defaults defaults2 greedy topk40}; do
      case $run in greedy) extra="--temperature 0";; topk40) extra="--top-k 40";; *) extra="";; esac
      [ $tree = base ] && { [ $run = topk40 ] || [[ " ${BASE_MODELS:-$MODELS} " != *" $m "* ]]; } && continue
      PYTHONPATH=$path timeout 300 $LLMC sample --checkpoint $CK/$m --max-new-tokens $TOKENS --backend cuda \
        --dtype bf16 $extra > "$OUT/text_${tree}_${m}_$run.txt" 2> "$OUT/err_${tree}_${m}_$run.txt" || rc=1
      echo "$tree $m $run: $(tail -n 1 "$OUT/err_${tree}_${m}_$run.txt")"
    done
  done
done 2>&1 | tee "$OUT/sample_summary.log"
if [ -n "${BASE:-}" ]; then
  for f in "$OUT"/text_base_*; do
    g=${f/text_base_/text_new_}
    [ -f "$g" ] && cmp -s "$f" "$g" && echo "same text: ${g##*/}" || echo "DIFFERENT text: ${g##*/}"
  done | tee -a "$OUT/sample_summary.log"
fi
if [ "${PROFILE:-1}" != 0 ]; then
  for m in $MODELS; do
    timeout 300 $PY "$HERE/backends/cuda/bench/sample_profile.py" $CK/$m $TOKENS > "$OUT/profile_$m.log" 2>&1 || rc=1
    head -n 22 "$OUT/profile_$m.log"
  done
fi
if [ "${DECODE_PROFILE:-0}" != 0 ]; then
  (timeout 200 $PY "$HERE/backends/cuda/bench/decode_profile.py" d12 1024 100 && timeout 200 $PY \
    "$HERE/backends/cuda/bench/decode_profile.py" llama3.2-1b 1024 100) > "$OUT/decode_profile.log" 2>&1 || rc=1
fi
(cd "$OUT" && tar -czf sample_logs.tgz --exclude sample_logs.tgz . && find . -type f ! -name sample_logs.tgz \
  ! -name sample_summary.log -delete)
exit $rc
