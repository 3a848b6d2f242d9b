#!/usr/bin/env bash
# How long `llmc train` takes to start on the CUDA backend, fresh (empty kernel and plan caches) and warm (the
# caches the fresh run left): every output line stamped with seconds since the command began, then step times.
#   bash backends/cuda/bench/start_check.sh     (logs under $OUT or ./start_out)
# MODEL/B/T/DTYPE/STEPS from the environment (d12, 64, 1024, bf16, 12). PROFILE="fresh warm" adds cProfiles of a
# fresh and a warm 3-step run (top 45 by cumulative time) and `python -X importtime` of the command's imports.
# RUNS=0 skips the timed runs.
set -u
export OUT=${OUT:-$PWD/start_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
MODEL=${MODEL:-d12}; B=${B:-64}; T=${T:-1024}; DTYPE=${DTYPE:-bf16}; STEPS=${STEPS:-12}
CACHE=/tmp/llmc_start_cache
cd /tmp
$PY - "$MODEL" <<'PY' || exit 1
import sys
from llmc_cli.bench.train_steps import random_shard
from llmc_cli.models.families import family_for
cfg = family_for(sys.argv[1]).preset(sys.argv[1])
print(random_shard("/tmp/llmc_start_data", cfg, 64 * 1024 * 40 + 1, 1))
PY
stamp() {  # each line prefixed with seconds since $1
  $PY -u -c "
import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    sys.stdout.write(f'{time.time() - t0:7.2f}s  {line}')
" "$1"
}
train() {
  $LLMC train --backend cuda --dtype $DTYPE --model $MODEL -b $B -t $T --data '/tmp/llmc_start_data/*.bin' \
    --steps $STEPS --val-every 0 --sample-every 0 "$@"
}
fresh() { rm -rf "$CACHE"; mkdir -p "$CACHE"; export CUPY_CACHE_DIR=$CACHE/cupy LLMC_CACHE_DIR=$CACHE/llmc; }
profile() {  # profile NAME: cProfile of a 3-step run into $OUT/NAME_profile.txt (top 45 by cumulative time)
  timeout 300 $PY -m cProfile -o "$OUT/$1.prof" -m llmc_cli train --backend cuda --dtype $DTYPE --model $MODEL \
    -b $B -t $T --data '/tmp/llmc_start_data/*.bin' --steps 3 --val-every 0 --sample-every 0 > "$OUT/$1_profiled.log" 2>&1
  $PY -c "
import pstats, sys
pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(45)" "$OUT/$1.prof" 2>&1 | tail -n 60 \
    > "$OUT/$1_profile.txt"
}
case " ${PROFILE:-} " in *" fresh "*)
  fresh
  $PY -X importtime -c "import llmc_cli.commands.main" 2> "$OUT/importtime.txt"
  sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -n 25 > "$OUT/importtime_top.txt"
  fresh; profile fresh;;
esac
case " ${PROFILE:-} " in *" warm "*)
  fresh; profile warm_fill; profile warm;;
esac
# cold: no cache at all; prepared: after `llmc backends --prepare` (install.sh's last step: kernels compiled, no
# cuBLASLt decisions or cuDNN plans yet); warm, warm2: with what the runs before left
fresh
for run in $([ "${RUNS:-1}" = 0 ] || echo cold prepare prepared warm warm2); do
  t0=$(date +%s.%N)
  if [ $run = prepare ]; then
    fresh
    $LLMC backends --prepare 2>&1 | stamp "$t0" | tee "$OUT/prepare.log"
    continue
  fi
  timeout 300 bash -c "$(declare -f train); LLMC='$LLMC' DTYPE=$DTYPE MODEL=$MODEL B=$B T=$T STEPS=$STEPS train" 2>&1 \
    | stamp "$t0" > "$OUT/start_$run.log"
  echo "== $run"; grep -E "model:|step +1/|step +2/|step +3/|graphs" "$OUT/start_$run.log" | cut -c1-110
  grep -E "step +[0-9]+/" "$OUT/start_$run.log" | sed -E 's/.*\| *([0-9.]+) ms.*/\1/' | tr '\n' ' '; echo
done
du -sh "$CACHE"/* 2>/dev/null
exit $rc
