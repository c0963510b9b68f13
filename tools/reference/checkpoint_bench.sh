#!/bin/bash
# Checkpoint costs at llama-1b on one GPU (issue 24), from the repository root after a build:
#   tools/reference/checkpoint_bench.sh
# Four runs of configs/llama-1b.yaml (bf16, STEPS steps each, about 4 minutes in all on an H200):
#   a) no checkpoint: the baseline step time
#   b) one synchronous save after step STEPS/2 (keep_last 1)
#   c) a resume from b's checkpoint, one step: the time to load it and to the first step
#   d) one background save (checkpoint.async) after step STEPS/2
# Each case writes under one temporary folder, deleted when the case is done (and on exit), so
# that at most one checkpoint (about 17 GiB) is on the disk at a time; df is printed before and
# after. The table at the end: sync save time, async training-loop stall and write time, size
# on disk, write bandwidth, resume time. The setup is checked first (binary, config, every --set
# key through --print-config, free disk > 3x the checkpoint) and nothing runs when it fails.
# Environment: ACCEL_BIN (default build/bin), CONFIG (default configs/llama-1b.yaml), STEPS
# (default 20), BENCH_TMP (folder for the temporary output, default /tmp), BENCH_EXTRA (more
# accel-train flags for every run, e.g. "--set training.seq_len=64" to check the flow on a CPU
# with configs/llama-tiny.yaml), FREE_FACTOR (free disk needed, in checkpoint sizes; default 3).
# Needs python3 (no packages). Not a test; not part of the build.
set -euo pipefail
BIN=${ACCEL_BIN:-build/bin}
CONFIG=${CONFIG:-configs/llama-1b.yaml}
STEPS=${STEPS:-20}
BENCH_TMP=${BENCH_TMP:-/tmp}
read -r -a EXTRA <<<"${BENCH_EXTRA:-}"
FREE_FACTOR=${FREE_FACTOR:-3}
TRAIN="$BIN/accel-train"
SAVE_AT=$((STEPS / 2))

die() {
  echo "checkpoint_bench: $*" >&2
  exit 2
}
[ -x "$TRAIN" ] || die "$TRAIN: not found or not executable (build first: ninja -C build accel-train)"
[ -f "$CONFIG" ] || die "$CONFIG: no such config (run from the repository root)"
[ "$STEPS" -ge 6 ] || die "STEPS=$STEPS: at least 6 (a median before and after the save)"
command -v python3 >/dev/null || die "python3 is needed to read the logs"
[ -d "$BENCH_TMP" ] || die "BENCH_TMP=$BENCH_TMP: no such folder"

# Every run shares these; the cases add their own --set. Each key exists in runtime/config.cpp.
COMMON=(--config "$CONFIG" --set training.max_steps="$STEPS" --set training.log_every=1
        --set training.progress=plain --set logging.tensorboard=false
        --set checkpoint.at_end=false --set checkpoint.keep_last=1 "${EXTRA[@]}")
SYNC=(--set checkpoint.every_steps="$SAVE_AT" --set checkpoint.async=false)
ASYNC=(--set checkpoint.every_steps="$SAVE_AT" --set checkpoint.async=true)
# A typo in a key or value fails here (exit 2, no GPU needed), not after minutes of device time.
for extra in "" "${SYNC[*]}" "${ASYNC[*]}"; do
  # shellcheck disable=SC2086
  "$TRAIN" "${COMMON[@]}" $extra --print-config >/dev/null ||
    die "accel-train refused the flags: ${COMMON[*]} $extra"
done

# The checkpoint's size from the model's shape: fp32 weights and two fp32 AdamW moments.
EXPECTED_GIB=$("$TRAIN" "${COMMON[@]}" --print-config | python3 -c '
import re, sys
v = {}
for line in sys.stdin:
    m = re.match(r"\s+(hidden_size|num_hidden_layers|num_attention_heads|num_key_value_heads|"
                 r"intermediate_size|vocab_size|tie_word_embeddings|head_dim):\s*(\S+)", line)
    if m and m.group(1) not in v:
        v[m.group(1)] = m.group(2)
h, l, i, voc = (int(v[k]) for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                    "vocab_size"))
heads, kv = int(v["num_attention_heads"]), int(v["num_key_value_heads"])
hd = int(v["head_dim"]) if v.get("head_dim", "0").isdigit() and int(v.get("head_dim", 0)) > 0 \
    else h // heads
tied = v.get("tie_word_embeddings", "false") == "true"
layer = h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * i + 2 * h
params = voc * h * (1 if tied else 2) + l * layer + h
print(f"{params * 12 / 2**30:.2f}")
')
OUT=$(mktemp -d "$BENCH_TMP/ckpt_bench.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
FREE_GIB=$(df -P -k "$OUT" | awk 'NR == 2 {printf "%.1f", $4 / 1048576}')
python3 -c "import sys; sys.exit(0 if $FREE_GIB > $FREE_FACTOR * $EXPECTED_GIB else 1)" ||
  die "$FREE_GIB GiB free under $BENCH_TMP, need more than $FREE_FACTOR x $EXPECTED_GIB GiB (the checkpoint); free space, or set BENCH_TMP, or FREE_FACTOR (one checkpoint is on the disk at a time)"

echo "== checkpoint_bench: $CONFIG, $STEPS steps per run, a save after step $SAVE_AT"
echo "   expected checkpoint: $EXPECTED_GIB GiB; $FREE_GIB GiB free in $OUT"
echo "   cases: a) baseline  b) sync save  c) resume from b's checkpoint (1 step)  d) async save"
echo "   common flags: ${COMMON[*]}"
df -h "$OUT"

# run NAME ARGS...: one accel-train run into $OUT/NAME, its log kept in $OUT/NAME.log; prints
# its wall time and what was on disk after it.
run() {
  local name=$1
  shift
  echo "== $name: $TRAIN ${COMMON[*]} $* --output-dir $OUT/$name"
  local t0 t1
  t0=$(date +%s.%N)
  "$TRAIN" "${COMMON[@]}" "$@" --output-dir "$OUT/$name" >"$OUT/$name.log" 2>&1 || {
    tail -20 "$OUT/$name.log"
    die "case $name failed (log above)"
  }
  t1=$(date +%s.%N)
  echo "$t0 $t1" >"$OUT/$name.wall"
  grep -E "^(saved checkpoint|resumed from|accel-train: WARNING)" "$OUT/$name.log" || true
  du -sh "$OUT/$name" | sed 's/^/   on disk: /'
}
# keep NAME: what the table needs from a case (metrics and log), before its folder goes.
keep() {
  mkdir -p "$OUT/kept"
  cp "$OUT/$1/metrics.jsonl" "$OUT/kept/$1.metrics.jsonl"
  cp "$OUT/$1.log" "$OUT/$1.wall" "$OUT/kept/"
}

run baseline
keep baseline
rm -rf "$OUT/baseline"

run sync "${SYNC[@]}"
keep sync
CKPT="$OUT/sync/checkpoints/step_$SAVE_AT"
[ -f "$CKPT/trainer_state.json" ] || die "case sync wrote no $CKPT"
du -sk "$CKPT" | awk '{print $1}' >"$OUT/kept/ckpt_kib"
run resume --set training.max_steps=$((SAVE_AT + 1)) --resume "$CKPT"
keep resume
rm -rf "$OUT/sync" "$OUT/resume"
df -h "$OUT"

run async "${ASYNC[@]}"
keep async
rm -rf "$OUT/async"
df -h "$OUT"

python3 - "$OUT/kept" "$SAVE_AT" <<'PY'
import json, re, statistics, sys
kept, save_at = sys.argv[1], int(sys.argv[2])

def step_times(name):
    t = {}
    for line in open(f"{kept}/{name}.metrics.jsonl"):
        j = json.loads(line)
        if "loss" in j and "elapsed_s" in j:
            t[j["step"]] = j["elapsed_s"]
    return t, {s: t[s] - t[s - 1] for s in sorted(t) if s - 1 in t}

def saved(name):
    for l in open(f"{kept}/{name}.log"):
        if l.startswith("saved checkpoint"):
            m = re.search(r"\(([\d.]+) GiB, ([\d.]+) GiB/s\), training blocked ([\d.]+) s \((\w+) "
                          r"snapshot(?:, device-to-host ([\d.]+) s)?\), written in ([\d.]+) s", l)
            if not m:
                sys.exit("cannot read the saved-checkpoint line: " + l)
            g = m.groups()
            return {"gib": float(g[0]), "gibps": float(g[1]), "blocked": float(g[2]),
                    "memory": g[3], "d2h": float(g[4] or 0), "write": float(g[5])}
    sys.exit(f"{name}: no 'saved checkpoint' line in its log")

_, base_dt = step_times("baseline")
base = statistics.median(v for s, v in base_dt.items() if s > 2)
rows = [("baseline step time (median of steps 3-)", f"{base:.3f} s")]
for name in ("sync", "async"):
    _, dt = step_times(name)
    s = saved(name)
    # The save runs after step save_at: its stall lands in step save_at + 1's interval.
    extra = dt[save_at + 1] - base
    rows.append((f"{name}: step {save_at + 1} minus the baseline step", f"{extra:.2f} s"))
    rows.append((f"{name}: training loop blocked (log)", f"{s['blocked']:.2f} s ({s['memory']} "
                 f"snapshot, device-to-host {s['d2h']:.2f} s)"))
    rows.append((f"{name}: write (files, checksums, fsync, rename)", f"{s['write']:.2f} s"))
    rows.append((f"{name}: write bandwidth", f"{s['gibps']:.2f} GiB/s"))
    if name == "sync":
        rows.append(("checkpoint size on disk", f"{s['gib']:.2f} GiB"))
for l in open(f"{kept}/resume.log"):
    m = re.search(r"^resumed from .* in ([\d.]+) s", l)
    if m:
        rows.append(("resume: load + checks (log)", f"{float(m.group(1)):.2f} s"))
t, _ = step_times("resume")
if save_at + 1 in t:
    rows.append((f"resume: first step after the load", f"{t[save_at + 1]:.2f} s"))
t0, t1 = map(float, open(f"{kept}/resume.wall").read().split())
rows.append(("resume: process wall time (start, load, 1 step, exit)", f"{t1 - t0:.1f} s"))
w = max(len(r[0]) for r in rows)
print("\n== checkpoint_bench results")
for k, v in rows:
    print(f"| {k:<{w}} | {v} |")
PY
