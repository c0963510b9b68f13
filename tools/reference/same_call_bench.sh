#!/usr/bin/env bash
# accel-train beside PyTorch in one GPU call, the comparison docs/performance.md reports:
#
#   tools/reference/same_call_bench.sh OUT_DIR [SIZE ...]     (default sizes: llama-125m llama-1b)
#
# For each size (configs/SIZE.yaml and torch_reference.py's shape of the same name): accel-bench
# single-process bf16 and fp8, then torch_reference.py's eager, compile and fp8-compile variants
# ("-ckpt" ones for llama-8b, which needs checkpointing on one GPU, as configs/llama-8b.yaml has),
# then accel-bench again, so that drift during the call shows as two rounds. Last,
# same_call_table.py prints the table; every file stays in OUT_DIR (logs included).
# Run from the repository root after building (ACCEL_BIN, default build/bin). Environment:
#   TORCH_VARIANTS   default "bf16 bf16-compile fp8-compile" (llama-8b: each with -ckpt)
#   TORCH_TIMEOUT    seconds per PyTorch run (default 240: compilation takes 30-120 s)
#   CONFIG_DIR       where SIZE.yaml is (default configs)
#   TORCH_REFERENCE  the PyTorch script (default tools/reference/torch_reference.py)
set -uo pipefail
out=${1:?usage: same_call_bench.sh OUT_DIR [SIZE ...]}
shift
sizes=("$@")
((${#sizes[@]})) || sizes=(llama-125m llama-1b)
bin=${ACCEL_BIN:-build/bin}
configs=${CONFIG_DIR:-configs}
mkdir -p "$out"
for size in "${sizes[@]}"; do
  [ -f "$configs/$size.yaml" ] || { echo "same_call_bench: no $configs/$size.yaml" >&2; exit 2; }
done

accel() {  # accel SIZE ROUND
  local steps=12 warmup=3
  case $1 in llama-1b) steps=8 warmup=2 ;; llama-8b) steps=4 warmup=1 ;; esac
  "$bin/accel-bench" --config "$configs/$1.yaml" --strategies single --num-processes 1 \
    --precisions bf16,fp8 --steps $steps --warmup $warmup --work-dir "$out/work" \
    --json "$out/accel_$1_r$2.json" > "$out/accel_$1_r$2.log" 2>&1
  echo "same_call_bench: accel-bench $1 round $2 exit $?"
}
torch_run() {  # torch_run SIZE VARIANT
  local steps=20
  case $1 in llama-1b) steps=15 ;; llama-8b) steps=5 ;; esac
  timeout "${TORCH_TIMEOUT:-240}" python3 "${TORCH_REFERENCE:-tools/reference/torch_reference.py}" "$1" "$2" $steps \
    > "$out/torch_$1_$2.log" 2>&1
  local rc=$?
  grep '^{' "$out/torch_$1_$2.log" | tail -1 > "$out/torch_$1_$2.json"
  echo "same_call_bench: torch_reference $1 $2 exit $rc"
}

export PYTHONUNBUFFERED=1
for size in "${sizes[@]}"; do
  accel "$size" 1
  for v in ${TORCH_VARIANTS:-bf16 bf16-compile fp8-compile}; do
    [ "$size" = llama-8b ] && [[ $v != *-ckpt ]] && v=$v-ckpt
    torch_run "$size" "$v"
  done
  accel "$size" 2
done
rm -rf "$out/work"
python3 "$(dirname "$0")/same_call_table.py" "$out" | tee "$out/table.md"
