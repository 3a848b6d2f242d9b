#!/usr/bin/env bash
# Whether runs of this tree compute the same bits, in one call: `llmc train` RUNS times on Shakespeare tokens, each
# with an empty llmc cache (FRESH=1, the default: no cuBLASLt decisions on disk, so every run races the candidates
# as a fresh machine's first run does) or all sharing one (FRESH=0), then the first step at which each run's loss
# parts from run 1's. VARIANTS ("; "-separated `llmc train` options, default "" and "--backend-opt tune=off") repeats
# the whole for each, and each variant's run 1 is compared with the first variant's: with tune=off nothing races, the
# control, and its bits are those every race must keep.
#   carry [".whl", "datasets/shakespeare"]; bash backends/cuda/bench/determinism_check.sh
# RUNS (4), STEPS (70), MODEL (d12), B (16), T (1024), DTYPE (fp8), FRESH (1), VARIANTS, DATA (a shard glob; default
# Shakespeare's GPT-2 tokens) from the environment; each run's log.jsonl goes to $OUT, the verdicts to
# $OUT/determinism.txt.
set -u
export OUT=${OUT:-$PWD/determinism_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
RUNS=${RUNS:-4}; STEPS=${STEPS:-70}; MODEL=${MODEL:-d12}; B=${B:-16}; T=${T:-1024}; DTYPE=${DTYPE:-fp8}
FRESH=${FRESH:-1}
DATA=${DATA:-$HERE/datasets/shakespeare/*train*.bin}
case $DATA in /*) ;; *) DATA=$HERE/$DATA ;; esac  # (the runs start in /tmp)
IFS=';' read -ra VS <<< "${VARIANTS:-;--backend-opt tune=off}"
v=0
for extra in "${VS[@]}"; do
  v=$((v + 1))
  shared=$(mktemp -d)
  for r in $(seq 1 "$RUNS"); do
    cache=$shared; [ "$FRESH" = 1 ] && cache=$(mktemp -d)
    (cd /tmp && LLMC_CACHE_DIR=$cache timeout 300 $PY -m llmc_cli train --backend cuda --dtype "$DTYPE" \
       --model "$MODEL" -b "$B" -t "$T" --steps "$STEPS" --data "$DATA" --val-every 0 --sample-every 0 $extra \
       --log "$OUT/v${v}_run$r.jsonl" > "$OUT/v${v}_run$r.out" 2>&1) \
      || { echo "determinism_check: variant $v run $r failed"; tail -n 5 "$OUT/v${v}_run$r.out"; rc=1; }
    rm -f "$OUT/v${v}_run$r.out"
  done
  $PY - "$OUT" "$v" "$RUNS" "$extra" "$FRESH" <<'PY' | tee -a "$OUT/determinism.txt"
import json, sys
out, v, runs, extra, fresh = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
def losses(name):
    try:
        rows = [json.loads(l) for l in open(f"{out}/{name}.jsonl") if l.strip()]
        return {x["step"]: x["loss"] for x in rows if x.get("loss") is not None}
    except OSError:
        return None
head = f"[{extra or 'default options'}; {'empty cache each run' if fresh == '1' else 'one cache'}]"
first = losses(f"v{v}_run1")
# each run against its variant's first; a later variant's first against the first variant's (tune=off: the same
# bits as a race's, whichever candidate won)
pairs = [(f"run {r}", losses(f"v{v}_run{r}"), first) for r in range(2, runs + 1)]
if v != "1":
    pairs.append(("run 1 against variant 1's run 1", first, losses("v1_run1")))
for name, ls, ref in pairs:
    if ls is None or ref is None:
        print(head, f"{name}: no log")
        continue
    apart = sorted(s for s in ls if s in ref and ls[s] != ref[s])
    print(head, f"{name}:", f"parts at step {apart[0]}" if apart else f"the same {len(ls)} losses")
PY
done
exit $rc
