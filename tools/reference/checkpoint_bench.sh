#!/bin/bash
# Checkpoint costs at llama-1b on one GPU (issue 24), from the repository root after a build:
#   tools/reference/checkpoint_bench.sh
# Four runs of configs/llama-1b.yaml (bf16, STEPS steps each, about 5 minutes in all on an H200):
#   a) no checkpoint: the baseline step time
#   b) one synchronous save after step STEPS/2 (keep_last 1); a synchronous run reserves no
#      snapshot memory up front, so its save also allocates (and pins) its block
#   c) a resume from b's checkpoint, one step: the time to load it and to the first step
#   d) ASYNC_SAVES background saves (checkpoint.async, every_steps ceil(STEPS / (ASYNC_SAVES +
#      1)), keep_last 1): the run reserves the pinned snapshot block at setup, before step 1
#      (its `checkpoint: reserved` line, timed on its own), so the first save stalls for its
#      copy only; a later save reuses the block (and first waits for the previous save's writer
#      where that one is still writing: logged apart, not in "training blocked")
# Each case writes under one temporary folder, deleted when the case is done (and on exit):
# cases b and c hold one checkpoint (about 17 GiB) on the disk, case d two at its peak (the
# previous one stays until its successor is complete); df is printed before and after. The
# table at the end: the reservation at setup, the sync save's stall, each async save's stall
# (first and later), write times and bandwidth, the bytes written, the resume time. The setup is
# checked first (binary, config, every --set key through --print-config, free disk > FREE_FACTOR
# checkpoints) and nothing runs when it fails.
# Environment: ACCEL_BIN (default build/bin), CONFIG (default configs/llama-1b.yaml), STEPS
# (default 20), ASYNC_SAVES (saves in case d, default 2; 1 leaves later saves unmeasured and
# needs one checkpoint of disk), BENCH_TMP (folder for the temporary output, default /tmp),
# BENCH_EXTRA (more accel-train flags for every run, e.g. "--set training.seq_len=64" to check the
# flow on a CPU with configs/llama-tiny.yaml), FREE_FACTOR (free disk needed, in checkpoint
# sizes; default 3, at least 2 with ASYNC_SAVES above 1).
# Needs python3 (no packages). Not a test; not part of the build.
set -euo pipefail
BIN=${ACCEL_BIN:-build/bin}
CONFIG=${CONFIG:-configs/llama-1b.yaml}
STEPS=${STEPS:-20}
BENCH_TMP=${BENCH_TMP:-/tmp}
read -r -a EXTRA <<<"${BENCH_EXTRA:-}"
FREE_FACTOR=${FREE_FACTOR:-3}
ASYNC_SAVES=${ASYNC_SAVES:-2}
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
[[ "$ASYNC_SAVES" =~ ^[1-9][0-9]*$ ]] || die "ASYNC_SAVES=$ASYNC_SAVES: a positive integer"
# Case d's saves: every ASYNC_EVERY steps, exactly ASYNC_SAVES of them before the last step (a
# save at STEPS itself would be at_end's, which is off).
ASYNC_EVERY=$(((STEPS + ASYNC_SAVES) / (ASYNC_SAVES + 1)))
[ $(((STEPS - 1) / ASYNC_EVERY)) -eq "$ASYNC_SAVES" ] ||
  die "STEPS=$STEPS cannot hold $ASYNC_SAVES async saves every $ASYNC_EVERY steps; raise STEPS"
python3 -c "import sys; sys.exit(0 if $ASYNC_SAVES == 1 or $FREE_FACTOR >= 2 else 1)" ||
  die "FREE_FACTOR=$FREE_FACTOR: at least 2 with ASYNC_SAVES=$ASYNC_SAVES (two checkpoints at the peak of case d), or ASYNC_SAVES=1"

# Every run shares these; the cases add their own --set. Each key exists in runtime/config.cpp.
COMMON=(--config "$CONFIG" --set training.max_steps="$STEPS" --set training.log_every=1
        --set training.progress=plain --set logging.tensorboard=false
        --set checkpoint.at_end=false --set checkpoint.keep_last=1 "${EXTRA[@]}")
SYNC=(--set checkpoint.every_steps="$SAVE_AT" --set checkpoint.async=false)
ASYNC=(--set checkpoint.every_steps="$ASYNC_EVERY" --set checkpoint.async=true)
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

echo "== checkpoint_bench: $CONFIG, $STEPS steps per run; sync: a save after step $SAVE_AT;" \
  "async: $ASYNC_SAVES saves, every $ASYNC_EVERY steps"
echo "   expected checkpoint: $EXPECTED_GIB GiB; $FREE_GIB GiB free in $OUT"
echo "   cases: a) baseline  b) sync save  c) resume from b's checkpoint (1 step)  d) async saves"
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
  grep -E "^(checkpoint: reserved|saved checkpoint|resumed from|accel-train: (WARNING|error))" \
    "$OUT/$name.log" || true
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
# The bytes written: every file's size (what the saved-checkpoint line counts), not blocks.
find "$CKPT" -maxdepth 1 -type f -printf '%s\n' | awk '{n += $1} END {print n}' >"$OUT/kept/ckpt_bytes"
run resume --set training.max_steps=$((SAVE_AT + 1)) --resume "$CKPT"
keep resume
rm -rf "$OUT/sync" "$OUT/resume"
df -h "$OUT"

run async "${ASYNC[@]}"
keep async
rm -rf "$OUT/async"
df -h "$OUT"

python3 - "$OUT/kept" "$SAVE_AT" "$ASYNC_EVERY" <<'PY'
import json, re, statistics, sys
kept, save_at, async_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def step_times(name):
    t = {}
    for line in open(f"{kept}/{name}.metrics.jsonl"):
        j = json.loads(line)
        if "loss" in j and "elapsed_s" in j:
            t[j["step"]] = j["elapsed_s"]
    return t, {s: t[s] - t[s - 1] for s in sorted(t) if s - 1 in t}

def saves(name):
    """Every 'saved checkpoint' line of a case's log, in order (the order of the saves)."""
    out = []
    for l in open(f"{kept}/{name}.log"):
        if l.startswith("saved checkpoint"):
            m = re.search(r"step_(\d+): [\d.e+-]+ GB \(([\d.]+) GiB, ([\d.]+) GiB/s\), training "
                          r"blocked ([\d.]+) s \((\w+) snapshot(?:, device-to-host ([\d.]+) s)?\), "
                          r"written in ([\d.]+) s(?:, after waiting ([\d.]+) s for the previous "
                          r"save to be written)?", l)
            if not m:
                sys.exit("cannot read the saved-checkpoint line: " + l)
            g = m.groups()
            out.append({"step": int(g[0]), "gib": float(g[1]), "gibps": float(g[2]),
                        "blocked": float(g[3]), "memory": g[4], "d2h": float(g[5] or 0),
                        "write": float(g[6]), "waited": float(g[7] or 0)})
    if not out:
        sys.exit(f"{name}: no 'saved checkpoint' line in its log")
    return out

def reservation(name):
    for l in open(f"{kept}/{name}.log"):
        m = re.match(r"checkpoint: reserved ([\d.]+) GiB \((\d+) bytes\) of (\w+) host memory "
                     r"for background saves in ([\d.]+) s", l)
        if m:
            return {"gib": float(m.group(1)), "bytes": int(m.group(2)), "memory": m.group(3),
                    "s": float(m.group(4))}
    return None

_, base_dt = step_times("baseline")
base = statistics.median(v for s, v in base_dt.items() if s > 2)
ckpt_bytes = int(open(f"{kept}/ckpt_bytes").read())
rows = [("baseline step time (median of steps 3-)", f"{base:.3f} s"),
        ("checkpoint size on disk (bytes written)", f"{ckpt_bytes / 2**30:.2f} GiB "
                                                   f"({ckpt_bytes} bytes)")]
if reservation("sync") is not None:
    sys.exit("the sync case reserved snapshot memory at setup; only async periodic runs should")
r = reservation("async")
rows.append(("async: snapshot block reserved at setup, before step 1 (log)",
             f"{r['gib']:.2f} GiB {r['memory']} in {r['s']:.2f} s" if r else "none (!)"))
sync_blocked = None
for name in ("sync", "async"):
    _, dt = step_times(name)
    for i, s in enumerate(saves(name)):
        which = "" if name == "sync" else (" first save" if i == 0 else f" save {i + 1} (later)")
        label = f"{name}{which} after step {s['step']}"
        # A save after step N stalls step N + 1's interval (the at_end save has none).
        if s["step"] + 1 in dt:
            rows.append((f"{label}: step {s['step'] + 1} minus the baseline step",
                         f"{dt[s['step'] + 1] - base:.2f} s"))
        rows.append((f"{label}: training loop blocked (log)",
                     f"{s['blocked']:.2f} s ({s['memory']} snapshot, device-to-host "
                     f"{s['d2h']:.2f} s)"))
        if s["waited"] > 0:
            rows.append((f"{label}: waited first for the previous save's writer",
                         f"{s['waited']:.2f} s"))
        rows.append((f"{label}: write (files, checksums, fsync, rename)",
                     f"{s['write']:.2f} s, {s['gibps']:.2f} GiB/s, {s['gib']:.2f} GiB"))
        if name == "sync":
            sync_blocked = s["blocked"]
        elif i == 0 and sync_blocked:
            rows.append((f"{label}: stall / sync save's stall (target <= 10%)",
                         f"{100 * s['blocked'] / sync_blocked:.1f} %"))
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
