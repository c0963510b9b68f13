#!/bin/bash
# optimizer.state_dtype and optimizer.master_weights on one GPU (issue 25): llama-125m
# (configs/llama-125m.yaml, bf16 compute) trained STEPS steps (default 1,000) three times from the
# same seed and data: fp32 masters with fp32 AdamW moments (the default, "fp32"), fp32 masters with
# bf16 moments ("bf16": optimizer.state_dtype bf16), and bf16 masters updated with stochastic
# rounding plus bf16 moments ("bf16-sr": optimizer.master_weights bf16 as well), from the
# repository root after a build:
#   TEXT_DIR=/path/to/fortunes tools/reference/optimizer_state_bench.sh
# The data: with SHARDS_DIR, its train.tok and eval.tok (made by tools/reference/markov_corpus.py:
# a source with a known loss floor that 1,000 steps cannot memorise; the convergence measurement).
# Otherwise text files (byte tokenizer; the model keeps llama-125m's 32,000-entry vocabulary):
# every regular file in TEXT_DIR (default /usr/share/games/fortunes, Debian's fortunes, as the
# llama-tiny demo uses; 1,000 steps memorise them). Without either the runs fall back to synthetic
# tokens, whose uniform random tokens say nothing about convergence (the script says so). Learning
# rate 6e-4, cosine to 10%, 100 warmup steps, eval every 250 steps (every 100 with SHARDS_DIR).
# PLOT=FILE.svg also draws the three runs' loss curves (accel-plot) into FILE.svg.
# Printed per run: final loss, mean of the last 50 logged losses, final eval loss, median tok/s
# (steps after the first 10), peak memory (GiB, from the summary) with its OptimizerState part,
# and the host-side optimizer time per step (host_busy_ms_per_step.optimizer, a share of the step
# time; the GPU time of the AdamW kernels themselves needs ncu or nsys), then each run's
# differences from fp32.
# Environment: ACCEL_BIN (default build/bin), CONFIG (default configs/llama-125m.yaml), STEPS,
# SHARDS_DIR, TEXT_DIR, PLOT, BENCH_TMP (default /tmp), BENCH_EXTRA (more accel-train flags for every run, e.g.
# "--set training.seq_len=64 --set training.micro_batch_size=2 --set mixed_precision=bf16" with
# CONFIG=configs/llama-tiny.yaml to check the flow on a CPU: bf16 masters need bf16 compute, which
# llama-125m has and llama-tiny does not). Needs python3 (no packages). Not a test; not part of
# the build.
set -euo pipefail
BIN=${ACCEL_BIN:-build/bin}
CONFIG=${CONFIG:-configs/llama-125m.yaml}
STEPS=${STEPS:-1000}
TEXT_DIR=${TEXT_DIR:-/usr/share/games/fortunes}
SHARDS_DIR=${SHARDS_DIR:-}
PLOT=${PLOT:-}
BENCH_TMP=${BENCH_TMP:-/tmp}
read -r -a EXTRA <<<"${BENCH_EXTRA:-}"
TRAIN="$BIN/accel-train"

die() {
  echo "optimizer_state_bench: $*" >&2
  exit 2
}
[ -x "$TRAIN" ] || die "$TRAIN: not found or not executable (build first: ninja -C build accel-train)"
[ -f "$CONFIG" ] || die "$CONFIG: no such config (run from the repository root)"
[ "$STEPS" -ge 60 ] || die "STEPS=$STEPS: at least 60 (the mean of the last 50 losses)"
command -v python3 >/dev/null || die "python3 is needed to read the logs"
WORK=$(mktemp -d "$BENCH_TMP/optimizer_state_bench.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# The data: a config that extends CONFIG with the shards, the text files or synthetic tokens.
FILES=()
if [ -n "$SHARDS_DIR" ]; then
  for f in train eval; do
    [ -f "$SHARDS_DIR/$f.tok" ] ||
      die "SHARDS_DIR=$SHARDS_DIR has no $f.tok (make them: python3 tools/reference/markov_corpus.py $SHARDS_DIR)"
  done
else
  mapfile -t FILES < <(find "$TEXT_DIR" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' 2>/dev/null | sort)
fi
{
  echo "extends: $(realpath "$CONFIG")"
  if [ -n "$SHARDS_DIR" ]; then
    echo "data:"
    echo "  source: shards"
    echo "  train_path: $(realpath "$SHARDS_DIR/train.tok")"
    echo "  eval_path: $(realpath "$SHARDS_DIR/eval.tok")"
  elif [ "${#FILES[@]}" -gt 0 ]; then
    echo "data:"
    echo "  source: text"
    echo "  tokenizer: byte"
    echo "  eval_fraction: 0.05"
    echo "  text_files:"
    for f in "${FILES[@]}"; do echo "    - $f"; done
  else
    echo "optimizer_state_bench: no text files in $TEXT_DIR: synthetic tokens (uniform random;" \
      "the losses say nothing about convergence, only speed and memory are meaningful)" >&2
  fi
} >"$WORK/bench.yaml"
EVAL=(--set training.eval_every=250 --set training.eval_batches=8)
[ -z "$SHARDS_DIR" ] || EVAL=(--set training.eval_every=100 --set training.eval_batches=16)
[ -n "$SHARDS_DIR" ] || [ "${#FILES[@]}" -gt 0 ] || EVAL=(--set training.eval_every=0)

COMMON=(--config "$WORK/bench.yaml" --set training.max_steps="$STEPS" --set training.log_every=1
        --set training.progress=plain --set training.seed=1234 --set logging.tensorboard=false
        --set checkpoint.at_end=false --set checkpoint.every_steps=0
        --set optimizer.lr=6e-4 --set optimizer.lr_schedule=cosine
        --set optimizer.warmup_steps=100 --set optimizer.min_lr_ratio=0.1 "${EVAL[@]}"
        "${EXTRA[@]}")
# The runs: name -> flags (RUNS in order).
RUNS=(fp32 bf16 bf16-sr)
declare -A FLAGS=(
  [fp32]="--set optimizer.state_dtype=fp32 --set optimizer.master_weights=fp32"
  [bf16]="--set optimizer.state_dtype=bf16 --set optimizer.master_weights=fp32"
  [bf16-sr]="--set optimizer.state_dtype=bf16 --set optimizer.master_weights=bf16")
# A typo in a key or value fails here (exit 2, no GPU needed), not after minutes of device time.
for run in "${RUNS[@]}"; do
  read -r -a flags <<<"${FLAGS[$run]}"
  "$TRAIN" "${COMMON[@]}" "${flags[@]}" --print-config >/dev/null ||
    die "accel-train refused the flags: ${COMMON[*]} ${FLAGS[$run]}"
done

for run in "${RUNS[@]}"; do
  read -r -a flags <<<"${FLAGS[$run]}"
  echo "== $run (${FLAGS[$run]}): $STEPS steps" >&2
  "$TRAIN" "${COMMON[@]}" "${flags[@]}" --output-dir "$WORK/$run" \
    >"$WORK/$run.log" 2>&1 || { tail -20 "$WORK/$run.log"; die "the $run run failed"; }
  tail -3 "$WORK/$run.log" >&2
done

if [ -n "$PLOT" ]; then
  "$BIN/accel-plot" -o "$PLOT" --from-step 50 --title "llama-125m: AdamW state in fp32 and bf16" \
    "$WORK/fp32=fp32 masters + moments" "$WORK/bf16=bf16 moments" \
    "$WORK/bf16-sr=bf16 masters (stochastic rounding) + moments" || die "accel-plot failed"
fi

python3 - "$WORK" <<'EOF'
import json, statistics, sys
work = sys.argv[1]

def read(name):
    steps, evals, summary = [], [], None
    with open(f"{work}/{name}/metrics.jsonl") as f:
        for line in f:
            j = json.loads(line)
            if j.get("summary"):
                summary = j
            elif "loss" in j:
                steps.append(j)
            elif "eval_loss" in j:
                evals.append(j)
    for j in steps:
        if "eval_loss" in j:
            evals.append(j)
    last50 = [j["loss"] for j in steps[-50:]]
    tps = [j["tokens_per_s"] for j in steps[10:] if "tokens_per_s" in j]
    opt = [j["host_busy_ms_per_step"]["optimizer"] for j in steps[10:]
           if "host_busy_ms_per_step" in j]
    busy = [sum(j["host_busy_ms_per_step"].values()) + j.get("host_wait_ms_per_step", 0)
            for j in steps[10:] if "host_busy_ms_per_step" in j]
    peak = summary.get("peak_memory_bytes", {}) if summary else {}
    gib = lambda b: b / 2**30
    return {
        "final_loss": steps[-1]["loss"],
        "mean_last50": statistics.mean(last50),
        "final_eval": summary.get("final_eval_loss", evals[-1]["eval_loss"] if evals else float("nan"))
        if summary else float("nan"),
        "tok_s": statistics.median(tps) if tps else float("nan"),
        "peak_gib": gib(peak.get("total", 0)) if isinstance(peak, dict) else float("nan"),
        "optstate_gib": gib(peak.get("optimizer_state", 0)) if isinstance(peak, dict) else float("nan"),
        "opt_ms": statistics.median(opt) if opt else float("nan"),
        "step_ms": statistics.median(busy) if busy else float("nan"),
        "evals": {j["step"]: j["eval_loss"] for j in evals if "step" in j},
    }

# fp32: fp32 masters and moments; bf16: bf16 moments; bf16-sr: bf16 masters (stochastic rounding)
# and bf16 moments.
rows = {run: read(run) for run in ("fp32", "bf16", "bf16-sr")}
print("| run | final loss | mean of last 50 | final eval loss | tok/s | peak GiB | "
      "optimizer state GiB | host optimizer ms/step (of step ms) |")
print("|---|---|---|---|---|---|---|---|")
for run, r in rows.items():
    print(f"| {run} | {r['final_loss']:.4f} | {r['mean_last50']:.4f} | {r['final_eval']:.4f} | "
          f"{r['tok_s']:,.0f} | {r['peak_gib']:.2f} | {r['optstate_gib']:.2f} | "
          f"{r['opt_ms']:.2f} ({r['step_ms']:.2f}) |")
eval_steps = sorted(set().union(*(r["evals"] for r in rows.values())))
if eval_steps:
    print("\n| eval loss at step | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for st in eval_steps:
        print(f"| {st} | " + " | ".join(f"{r['evals'].get(st, float('nan')):.4f}"
                                        for r in rows.values()) + " |")
    print()
a = rows["fp32"]
for run in ("bf16", "bf16-sr"):
    b = rows[run]
    print(f"{run} - fp32: final loss {b['final_loss'] - a['final_loss']:+.4f} "
          f"({(b['final_loss'] / a['final_loss'] - 1) * 100:+.2f}%), mean of last 50 "
          f"{b['mean_last50'] - a['mean_last50']:+.4f} "
          f"({(b['mean_last50'] / a['mean_last50'] - 1) * 100:+.2f}%), eval "
          f"{b['final_eval'] - a['final_eval']:+.4f}; tok/s x{b['tok_s'] / a['tok_s']:.3f}; peak "
          f"{b['peak_gib'] - a['peak_gib']:+.2f} GiB")
EOF
