#!/usr/bin/env bash
# fp8 against bf16 over seeds: trains CONFIG in bf16, fp8 TE and fp8 AO for each seed (JOBS runs at
# a time, one GPU shared), then prints each seed's final eval losses, fp8's difference to bf16,
# and the largest gradient norm after step 15 (a loss spike shows as > 3; usual 0.5-0.8).
#
#   tools/fp8_seed_sweep.sh CONFIG OUT_DIR "SEEDS" [JOBS] [--set KEY=VALUE ...]
#   tools/fp8_seed_sweep.sh configs/llama-tiny.yaml /tmp/sweep "1234 $(seq -s' ' 1 20)" 16
#
# Exits 1 when a run failed (its log is named) or ended without a final eval loss.
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
config=$1 out=$2 seeds=$3
shift 3
jobs=4
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
  jobs=$1
  shift
fi
bin=${ACCEL_BIN:-$(dirname "$0")/../build/bin}/accel-train  # ACCEL_BIN: the bin folder, as in tools/reference/
[ -x "$bin" ] || { echo "fp8_seed_sweep: no accel-train at $bin (build first, or set ACCEL_BIN to the folder holding it)" >&2; exit 2; }
mkdir -p "$out"
# The remaining options go to every run, quoted so that values keep their spaces.
EXTRA=$(printf '%q ' "$@")
run() {  # mode seed
  local m=$1 s=$2 a
  case $m in
    bf16) a="--set mixed_precision=bf16" ;;
    te) a="--set mixed_precision=fp8 --set fp8_config.backend=TE" ;;
    ao) a="--set mixed_precision=fp8 --set fp8_config.backend=AO" ;;
  esac
  rm -rf "$out/$m-$s"
  # shellcheck disable=SC2086
  if ! eval "\"\$bin\" --config \"\$config\" $a --set training.seed=\"\$s\" \
      --set training.log_every=1 --set training.progress=plain --set training.sample_tokens=0 \
      --set checkpoint.at_end=false --set checkpoint.every_steps=0 $EXTRA -o \"\$out/\$m-\$s\"" \
      > "$out/$m-$s.log" 2>&1; then
    echo "fp8_seed_sweep: $m seed $s failed, see $out/$m-$s.log" >&2
    return 1
  fi
}
export -f run
export bin config out EXTRA
status=0
for s in $seeds; do for m in bf16 te ao; do echo "$m $s"; done; done |
  xargs -P "$jobs" -L 1 bash -c 'run "$0" "$1"' || status=1
python3 - "$out" $seeds <<'PY' || status=1
import json, sys
out, seeds = sys.argv[1], sys.argv[2:]
def get(m, s):  # (final eval loss, largest grad norm after step 15), or None
    try:
        js = [json.loads(l) for l in open(f"{out}/{m}-{s}/metrics.jsonl")]
    except (OSError, ValueError):
        return None
    final = [j["final_eval_loss"] for j in js if j.get("summary") and "final_eval_loss" in j]
    g = [j["grad_norm"] for j in js if "step" in j and j["step"] > 15 and "grad_norm" in j]
    return (final[-1], max(g) if g else float("nan")) if final else None
diff = {"te": [], "ao": []}
spikes = {"bf16": 0, "te": 0, "ao": 0}
missing = 0
for s in seeds:
    r = {m: get(m, s) for m in ("bf16", "te", "ao")}
    if None in r.values():
        missing += 1
        print(f"seed {s}: no final eval loss from {', '.join(m for m in r if r[m] is None)}")
        continue
    b = r["bf16"][0]
    parts = [f"bf16 {b:.4f} g{r['bf16'][1]:5.1f}"]
    for m in ("te", "ao"):
        d = 100 * (r[m][0] / b - 1)
        diff[m].append(d)
        parts.append(f"{m} {r[m][0]:.4f} ({d:+.2f}%) g{r[m][1]:5.1f}")
    for m in r:
        spikes[m] += r[m][1] > 3
    print(f"seed {s:>5}: " + " | ".join(parts))
for m in ("te", "ao"):
    d = diff[m]
    if d:
        print(f"{m}: mean {sum(d)/len(d):+.2f}%, max {max(d):+.2f}%, min {min(d):+.2f}%, "
              f"within 3% of bf16: {sum(abs(x) <= 3 for x in d)}/{len(d)}")
print("runs with a gradient-norm spike (> 3 after step 15): " +
      ", ".join(f"{m} {spikes[m]}" for m in spikes))
sys.exit(1 if missing else 0)
PY
exit $status
