#!/bin/bash
# Checkpoint costs at llama-1b on one GPU (issue 24), run from the repository root after a build:
#   tools/reference/checkpoint_bench.sh [OUT_DIR]        (default /tmp/accel_ckpt_bench)
# Three runs of configs/llama-1b.yaml (bf16, 16 steps, a checkpoint every 4 steps): synchronous
# saves, background saves (checkpoint.async), and a resume of the last checkpoint. Prints per
# run the median step time without a save, the time of each step right after a save (its
# stall: that step minus the median), what the log says each save wrote and took, the ratio
# async stall / sync save time (the issue's target: at most 0.10), and the resume time.
# Not a test; not part of the build. Needs python3 (no packages).
set -euo pipefail
OUT=${1:-/tmp/accel_ckpt_bench}
BIN=${ACCEL_BIN:-build/bin}
rm -rf "$OUT"
mkdir -p "$OUT"
COMMON=(--config configs/llama-1b.yaml --set training.max_steps=16 --set checkpoint.every_steps=4
        --set checkpoint.keep_last=2 --set training.progress=plain)

"$BIN/accel-train" "${COMMON[@]}" --output-dir "$OUT/sync" 2>&1 | tee "$OUT/sync.log"
"$BIN/accel-train" "${COMMON[@]}" --set checkpoint.async=true --output-dir "$OUT/async" \
  2>&1 | tee "$OUT/async.log"
# Resume step 12 and train one more step: the log line says how long the resume took.
"$BIN/accel-train" "${COMMON[@]}" --set training.max_steps=13 --output-dir "$OUT/resumed" \
  --resume "$OUT/sync/checkpoints/step_12" 2>&1 | tee "$OUT/resume.log"

python3 - "$OUT" <<'PY'
import json, re, statistics, sys
out = sys.argv[1]

def steps(run):
    t = {}
    for line in open(f"{out}/{run}/metrics.jsonl"):
        j = json.loads(line)
        if "step" in j and "elapsed_s" in j and "summary" not in j:
            t[j["step"]] = j["elapsed_s"]
    return {s: t[s] - t[s - 1] for s in sorted(t) if s - 1 in t}

def saves(run):
    return [l.strip() for l in open(f"{out}/{run}.log") if l.startswith("saved checkpoint")]

res = {}
for run in ("sync", "async"):
    dt = steps(run)
    after = {s: dt[s] for s in (5, 9, 13) if s in dt}  # the steps after the saves of 4, 8, 12
    base = statistics.median(v for s, v in dt.items() if s not in after and s > 2)
    stall = statistics.mean(v - base for v in after.values())
    res[run] = stall
    print(f"{run}: median step {base:.3f} s; steps after a save: "
          + ", ".join(f"{s}: {v:.3f} s" for s, v in after.items())
          + f"; mean stall {stall:.3f} s")
    for l in saves(run):
        print("  " + l)
print(f"async stall / sync stall: {res['async'] / res['sync']:.3f} (target <= 0.10)")
for l in open(f"{out}/resume.log"):
    if l.startswith("resumed from"):
        print(l.strip())
PY
