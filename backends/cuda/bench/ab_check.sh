#!/usr/bin/env bash
# Two trees' training speed side by side in one call: this tree against a base tree carried in .abbase/
# (`git archive BASE | tar -x -C .abbase`), GPT-2 d12 B=64 T=1024 bf16 on real tokens, runs alternated.
#   carry [".whl", ".abbase", "datasets/shakespeare"]; bash backends/cuda/bench/ab_check.sh
# ROUNDS (3), STEPS (30), MODEL (d12), B (64), T (1024), DTYPE (bf16), EXTRA (more `llmc train` options, e.g.
# "--recompute gelu"), DATA ('datasets/shakespeare/*train*.bin') and TAG (a prefix of the logs' names) from the
# environment. Each run's log.jsonl goes to $OUT; the summary is the median step (ms) after step 5 of each run,
# and the median of those per tree. Shards are real text: llm.c-style encoder backwards slow down on random ids.
set -u
export OUT=${OUT:-$PWD/ab_out}; mkdir -p "$OUT"
. "$(dirname "$0")/device_setup.sh"
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-30}; MODEL=${MODEL:-d12}; B=${B:-64}; T=${T:-1024}; DTYPE=${DTYPE:-bf16}
EXTRA=${EXTRA:-}; TAG=${TAG:-}
DATA=${DATA:-$HERE/datasets/shakespeare/*train*.bin}
[ -d "$HERE/.abbase" ] || { echo "ab_check: no .abbase/ (the base tree) was carried"; exit 2; }
rm -rf /tmp/llmc_base
$PY -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/llmc_base "$HERE/.abbase" \
  "$HERE/.abbase/backends/cpu" "$HERE/.abbase/backends/cuda" 2>&1 | tail -2
run() {  # tree round
  local site=/tmp/llmc; [ "$1" = base ] && site=/tmp/llmc_base
  (cd /tmp && PYTHONPATH=$site:/tmp/site timeout 300 $PY -m llmc_cli train --backend cuda --dtype "$DTYPE" \
     --model "$MODEL" -b "$B" -t "$T" --steps "$STEPS" --data "$DATA" --val-every 0 --sample-every 0 $EXTRA \
     --log "$OUT/$TAG$1_$2.jsonl" > "$OUT/$TAG$1_$2.out" 2>&1) \
    || { echo "ab_check: $1 round $2 failed"; tail -n 5 "$OUT/$TAG$1_$2.out"; }
}
for r in $(seq 1 "$ROUNDS"); do run base "$r"; run new "$r"; done
$PY - "$OUT" "$ROUNDS" "$TAG" <<'PY' | tee -a "$OUT/summary.txt"
import json, statistics, sys
out, rounds, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
per = {}
for tree in ("base", "new"):
    for r in range(1, rounds + 1):
        try:
            ms = [json.loads(l)["ms"] for l in open(f"{out}/{tag}{tree}_{r}.jsonl") if l.strip()]
        except OSError:
            continue
        med = statistics.median(ms[5:])
        per.setdefault(tree, []).append(med)
        print(f"{tag}{tree} round {r}: median {med:.1f} ms over steps 6-{len(ms)}")
if len(per) == 2:
    b, n = statistics.median(per["base"]), statistics.median(per["new"])
    print(f"{tag}base {b:.1f} ms, new {n:.1f} ms: new/base {n / b:.4f}")
PY
exit $rc
