#!/usr/bin/env bash
# Data-parallel scaling on the GPU machine, in one call: NCCL collectives through the cuda plugin's communicator,
# then GPT-2 d12 (B=64 per GPU, T=1024, bf16, ZeRO-1) and d48 (B=16 per GPU, --recompute gelu) on 1 GPU and on
# N GPUs (`llmc train --gpus N`), the N-GPU runs with the gradient reduction overlapped with the backward pass
# (--overlap) and after it (--no-overlap, the default), runs alternated; medians of steps after the first 5; the overlapped and
# the plain N-GPU runs must log the same losses (with 2 ranks the two reductions add the same pairs).
#   bash backends/cuda/bench/multi_gpu.sh [N=all GPUs] [STEPS=30]     (logs under $OUT or ./multi_gpu_out)
#   GPUS="2 4" ...         the multi-GPU runs on each of these counts (default N), each against the same 1-GPU runs
#   MODELS="d12 d24 d48"   d12 B=64, d24 B=32 (llm.c's 4-GPU figures), any other B=16 with --recompute gelu
#   (30 steps of d12 are 3.5 s, inside the GPUs' heat-up: 200 gave the steadier figures on 2x H200, 2026-11-26)
#   MODELS="d12 d48" ROUNDS=2 ZERO=1 VARIANTS="overlap plain z0overlap z0plain" ...
#   ONE_GPU_ON="0 1" ...   the 1-GPU baseline on each of these GPUs (default 0): is one GPU slower than the other?
#   PAIR=1 ...             also two 1-GPU runs at once, on GPUs 0 and 1 (no communication): what sharing the host
#                          and its power costs a GPU, apart from the reduction
#   WARMUP=0 ...           no uncounted N-GPU run before round 1 (default: one, so that round 1 starts warm too)
#   FRESH=1 ...            also a 1-GPU run on GPU 0 with an empty llmc cache (its own tuner race, kernels compiled
#                          afresh), named _1gpu_fresh; VARIANTS=fresh is the N-GPU run so
#   CLOCKS=1 ...           nvidia-smi samples every GPU each 200 ms during every run: median SM clock, power and
#                          temperature over the busy samples, per run and GPU, in clocks.log
#   PEER=1 ...             also a 1-GPU run on GPU 0 whose process first enables peer access to GPU 1 (idle), named
#                          _1gpu_peer: does a peer mapping alone slow the GPU's own kernels?
#   LINKS="awake bulk" ... also PAIR=1's two runs with a thread in each copying to the other GPU over the link
#                          (with_link_traffic.py: awake keeps the link busy with 64 KiB every 5 ms, bulk sends a d12
#                          rank's 250 MB a step), named _1gpu_<mode>0 / _<mode>1: does link traffic alone cost a step?
#   PHASES=1 ...           every run writes where its steps' time goes, rank by rank (LLMC_STEP_PHASES), summarized
#                          by bench/step_phases.py into phases.log
set -u
export OUT=${OUT:-$PWD/multi_gpu_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
N=${1:-$(nvidia-smi -L | wc -l)}; STEPS=${2:-30}; ROUNDS=${ROUNDS:-2}
nvidia-smi topo -m 2>&1 | head -9 | tee -a "$OUT/env.log"
# the links' low-power threshold: a link stays at full power this long after its last traffic, and at the GPUs' power
# cap that power comes out of the SM clock (docs/performance.md, "The links' low-power threshold")
nvidia-smi nvlink -gLowPwrInfo -i 0 2>&1 | grep -m2 "Link 0" | tee -a "$OUT/env.log"
mkdir -p /tmp/llmc_data /tmp/runs
(cd /tmp/runs && timeout 180 $PY "$HERE/backends/cuda/bench/nccl_check.py" "$N") 2>&1 | tail -n 20 \
  | tee "$OUT/nccl_check.log"
$PY -c "import numpy as np; from llmc_cli.formats.shards import write_shard; \
write_shard('/tmp/llmc_data/synth_train_000.bin', np.random.default_rng(0).integers(0, 50257, 20_000_000))"
LOGS=/tmp/multi_gpu_logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
run() {  # run NAME ARGS...: one llmc train, its median line appended to medians.log
  local name=$1; shift
  local ph=""; [ -n "${PHASES:-}" ] && ph="LLMC_STEP_PHASES=$LOGS/phases/$name"
  local smi=""
  if [ -n "${CLOCKS:-}" ]; then
    nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 200 \
      > "$LOGS/$name.smi.csv" 2>/dev/null & smi=$!
  fi
  # (COLUMNS=200: the step lines keep their grad norm, which losses() compares, in the log file)
  (cd /tmp/runs && env COLUMNS=200 $ENVS $ph timeout 240 ${CMD:-$LLMC} train "$@" --steps "$STEPS" --val-every 0 --sample-every 0 \
    --data '/tmp/llmc_data/synth_train_*.bin' > "$LOGS/$name.log" 2>&1) || { rc=1; tail -n 3 "$LOGS/$name.log"; }
  if [ -n "$smi" ]; then  # the busy samples (over 300 W) of each GPU: median SM clock, power, temperature
    kill "$smi"; wait "$smi" 2>/dev/null
    $PY - "$LOGS/$name.smi.csv" "$name" <<'PYEOF' | tee -a "$OUT/clocks.log"
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    try:
        g, clk, pwr, temp = (float(x) for x in line.split(","))
    except ValueError:
        continue
    if pwr > 300:
        rows[int(g)].append((clk, pwr, temp))
for g, r in sorted(rows.items()):
    med = [statistics.median(x[i] for x in r) for i in range(3)]
    print(f"{sys.argv[2]} GPU {g}: {len(r)} busy samples, SM clock {med[0]:.0f} MHz, {med[1]:.0f} W, {med[2]:.0f} C")
PYEOF
  fi
  $PY "$HERE/bench/train_median.py" --skip 5 "$LOGS/$name.log" | tee -a "$OUT/medians.log"
}
losses() { grep -oE "step +[0-9]+/[0-9]+ \| loss [0-9.]+ \| norm [0-9.]+" "$1"; }
# the N-GPU variants: plain (--no-overlap, the default: ZeRO's collectives through the GPUs' memory where two
# reach each other's, through NCCL for more), peer (plain through the GPUs' memory whatever their number:
# --backend-opt p2p=on), nccl (plain through NCCL: --backend-opt p2p=off), reduce (peer with the reduce-scatter
# loading the peers' chunks too: p2p_reduce=on), overlap (--overlap: where the GPUs use each other's memory, the
# pieces are copied to their owners by the copy engines; p2p=on), nccloverlap (--overlap through NCCL's reduce on
# SMs: --backend-opt p2p_copies=off), shm (plain with no peer access at all: NCCL through host memory,
# NCCL_P2P_DISABLE=1, and p2p=off), z0overlap / z0plain (--zero 0: every piece all-reduced)
variant() {
  ENVS="LLMC_X=1"; V="--zero ${ZERO:-1}"
  case $1 in
    overlap) V="$V --overlap --backend-opt p2p=on" ;;
    nccloverlap) V="$V --overlap --backend-opt p2p_copies=off" ;;
    shm) ENVS="NCCL_P2P_DISABLE=1"; V="$V --no-overlap --backend-opt p2p=off" ;;
    plain) V="$V --no-overlap" ;;
    fresh) ENVS="LLMC_CACHE_DIR=$(mktemp -d)"; V="$V --no-overlap" ;;  # (the cuBLASLt race of its own, as a first run)
    nccl) V="$V --no-overlap --backend-opt p2p=off" ;;
    peer) V="$V --no-overlap --backend-opt p2p=on" ;;
    reduce) V="$V --no-overlap --backend-opt p2p=on --backend-opt p2p_reduce=on" ;;
    z0overlap) V="--zero 0 --overlap" ;;
    z0plain) V="--zero 0 --no-overlap" ;;
  esac
}
for model in ${MODELS:-d12 d48}; do
  case $model in
    d12) A="--backend cuda --dtype bf16 --model d12 -b 64 -t 1024" ;;
    d24) A="--backend cuda --dtype bf16 --model d24 -b 32 -t 1024" ;;
    *) A="--backend cuda --dtype bf16 --model $model -b 16 -t 1024 --recompute gelu" ;;
  esac
  # a first N-GPU run, not counted: on a cool machine the first run was the fastest (2xH100, 2026-11-26: GPT-2 d48
  # on one GPU 337-339 ms in round 1, 344-349 in round 2), which biased round 1's baseline
  if [ "${WARMUP:-1}" = 1 ]; then variant plain; run "${model}_warmup" $A $V --gpus "$N" > /dev/null; fi
  for r in $(seq "$ROUNDS"); do
    for g in ${ONE_GPU_ON:-0}; do  # (GPU 0's runs are the baseline; another GPU's are named _1gpu_g<N>)
      ENVS="CUDA_VISIBLE_DEVICES=$g"; run "${model}_1gpu$([ "$g" = 0 ] || echo _g$g)_$r" $A --zero "${ZERO:-1}"
    done
    if [ -n "${PEER:-}" ]; then
      ENVS="CUDA_VISIBLE_DEVICES=0,1" CMD="$PY $HERE/backends/cuda/bench/with_peer_access.py"
      run "${model}_1gpu_peer_$r" $A --zero "${ZERO:-1}"; CMD=""
    fi
    if [ -n "${FRESH:-}" ]; then
      ENVS="CUDA_VISIBLE_DEVICES=0 LLMC_CACHE_DIR=$(mktemp -d)"; run "${model}_1gpu_fresh_$r" $A --zero "${ZERO:-1}"
    fi
    if [ -n "${PAIR:-}" ]; then
      (ENVS="CUDA_VISIBLE_DEVICES=1"; run "${model}_1gpu_paired1_$r" $A --zero "${ZERO:-1}" > /dev/null) &
      ENVS="CUDA_VISIBLE_DEVICES=0"; run "${model}_1gpu_paired0_$r" $A --zero "${ZERO:-1}"
      wait
    fi
    for mode in ${LINKS:-}; do
      (ENVS="CUDA_VISIBLE_DEVICES=1,0 LLMC_LINK_TRAFFIC=$mode" CMD="$PY $HERE/backends/cuda/bench/with_link_traffic.py"
       run "${model}_1gpu_${mode}1_$r" $A --zero "${ZERO:-1}" > /dev/null) &
      ENVS="CUDA_VISIBLE_DEVICES=0,1 LLMC_LINK_TRAFFIC=$mode" CMD="$PY $HERE/backends/cuda/bench/with_link_traffic.py"
      run "${model}_1gpu_${mode}0_$r" $A --zero "${ZERO:-1}"; CMD=""
      wait
    done
    for n in ${GPUS:-$N}; do
      for v in ${VARIANTS:-overlap plain}; do
        variant "$v"; run "${model}_${n}gpu_${v}_$r" $A $V --gpus "$n"
      done
    done
  done
  # with 2 ranks every reduction adds the same pairs: the same losses to the last digit; with more, NCCL's ring
  # and the peers' rank-order sums add in different orders, so a difference there is reported, not a failure
  for n in ${GPUS:-$N}; do
    for v in overlap nccl reduce nccloverlap; do
      [ -f "$LOGS/${model}_${n}gpu_plain_1.log" ] && [ -f "$LOGS/${model}_${n}gpu_${v}_1.log" ] || continue
      if cmp -s <(losses "$LOGS/${model}_${n}gpu_${v}_1.log") <(losses "$LOGS/${model}_${n}gpu_plain_1.log"); then
        echo "$model: $n GPUs, $v and plain log the same losses" | tee -a "$OUT/medians.log"
      else
        echo "$model: $n GPUs, the losses DIFFER between $v and plain" | tee -a "$OUT/medians.log"
        [ "$n" = 2 ] && rc=1
        diff <(losses "$LOGS/${model}_${n}gpu_${v}_1.log") <(losses "$LOGS/${model}_${n}gpu_plain_1.log") | head -6
      fi
    done
  done
done
[ -d "$LOGS/phases" ] && $PY "$HERE/bench/step_phases.py" "$LOGS"/phases/* | tee "$OUT/phases.log"
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
$PY - "$OUT" <<'PYEOF' | tee -a "$OUT/medians.log"
import re, statistics, sys
out = sys.argv[1]
rows = {}
for line in open(f"{out}/medians.log"):
    m = re.match(r".*/(\w+?)_(\d+gpu(?:_\w+?)?)_\d+\.log: .* median ([\d.]+) ms/step", line)
    if m:
        rows.setdefault((m[1], m[2]), []).append(float(m[3]))
for model in sorted({k[0] for k in rows}):
    one = rows.get((model, "1gpu"))
    for kind in sorted({k[1] for k in rows if k[0] == model and k[1] != "1gpu"}):
        many = rows.get((model, kind))
        if kind.startswith("1gpu_") and one and many:  # the baseline on another GPU
            print(f"{model} {kind}: 1 GPU {statistics.median(many):.1f} ms on that GPU, {statistics.median(one):.1f} "
                  f"on GPU 0 (medians of {len(many)} and {len(one)} runs)")
        elif one and many:
            n = int(kind.split("gpu")[0])
            t1, tn = statistics.median(one), statistics.median(many)
            print(f"{model} {kind}: 1 GPU {t1:.1f} ms, {n} GPUs {tn:.1f} ms/step for {n}x the tokens: "
                  f"scaling {t1 / tn:.1%} (medians of {len(one)} and {len(many)} runs)")
PYEOF
exit $rc
