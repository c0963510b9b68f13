#!/usr/bin/env bash
# SFT throughput on one GPU, in one call: accel-train on a prompt/completion JSONL packed
# (data.packing true: rows of seq_len, segment-masked attention, positions restarting per
# sample) and unpacked (one sample per row, padded to the longest in the batch), beside PyTorch +
# transformers padded the same way (tools/reference/torch_sft_reference.py). All report trained
# tokens/s (the completion tokens whose loss counts): accel-train's metrics.jsonl tokens_per_s,
# median over the steps after the first 5.
#
#   tools/reference/sft_bench.sh [SIZE] [STEPS]      (SIZE: configs/SIZE.yaml, default llama-1b)
#
# Environment: PACKED_MBS (rows of seq_len per step, default 4), PADDED_MBS (samples per step
# unpacked, accel-train and torch alike, default 8), SAMPLES (default 4000), OUT (default
# out/sft_bench). Prints one JSON line per run and a summary line.
set -euo pipefail
cd "$(dirname "$0")/../.."
size="${1:-llama-1b}"
steps="${2:-30}"
out="${OUT:-out/sft_bench}"
packed_mbs="${PACKED_MBS:-4}"
padded_mbs="${PADDED_MBS:-8}"
mkdir -p "$out"
data="$out/sft_bench.jsonl"
python3 tools/reference/make_sft_bench_data.py "$data" "${SAMPLES:-4000}" 2048

run_accel() {  # $1 = name, then --set overrides
  local name="$1"
  shift
  rm -rf "$out/$name"
  build/bin/accel-train --config "configs/$size.yaml" --output-dir "$out/$name" \
    --set data.source=jsonl --set "data.jsonl_files=[$data]" --set data.tokenizer=byte \
    --set data.format=prompt_completion --set data.eval_fraction=0 --set data.overlong=truncate \
    --set training.max_steps="$steps" --set training.log_every=1 --set training.progress=plain \
    --set training.sample_tokens=0 --set training.eval_every=0 --set checkpoint.at_end=false "$@" \
    > "$out/$name.log" 2>&1 || { tail -20 "$out/$name.log"; exit 1; }
  python3 - "$out/$name/metrics.jsonl" "$name" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = [l for l in lines if "step" in l and "tokens_per_s" in l][5:]
summary = [l for l in lines if l.get("summary")][0]
print(json.dumps({"run": sys.argv[2],
                  "trained_tokens_per_s": round(statistics.median(l["tokens_per_s"] for l in steps)),
                  "trained_fraction": round(summary["trained_fraction"], 3),
                  "peak_mem_gib": round(max(l["peak_mem_bytes"] for l in steps) / 2**30, 2),
                  "loss_last": round(steps[-1]["loss"], 3)}))
PY
}

run_accel accel_packed --set data.packing=true --set training.micro_batch_size="$packed_mbs" | tee "$out/results.jsonl"
run_accel accel_padded --set data.packing=false --set training.micro_batch_size="$padded_mbs" | tee -a "$out/results.jsonl"
(cd tools/reference && python3 torch_sft_reference.py "$(realpath "$data")" "$size" "$padded_mbs" "$steps") \
  | tee -a "$out/results.jsonl"
python3 - "$out/results.jsonl" <<'PY'
import json, sys
r = {}
for l in open(sys.argv[1]):
    j = json.loads(l)
    r[j.get("run", "torch_padded")] = j["trained_tokens_per_s"]
print(json.dumps({"summary": "trained tokens/s", **r,
                  "packed_over_padded": round(r["accel_packed"] / r["accel_padded"], 2),
                  "accel_padded_over_torch_padded": round(r["accel_padded"] / r["torch_padded"], 2),
                  "accel_packed_over_torch_padded": round(r["accel_packed"] / r["torch_padded"], 2)}))
PY
