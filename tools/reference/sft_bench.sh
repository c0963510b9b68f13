#!/usr/bin/env bash
# SFT throughput on one GPU, in one call: accel-train on a prompt/completion JSONL packed
# (data.packing true: rows of seq_len, segment-masked attention, positions restarting per
# sample), unpacked (one sample per row, padded to the longest in the batch), unpacked with
# data.pad_to_multiple_of 64 (at most seq_len / 64 row lengths, so the CUDA backend's per-length
# GEMM tuning and cuDNN attention plans are made once per length and then reused) and unpacked
# with ACCEL_GEMM_TUNING=0 (docs/data.md, "Padded speed on CUDA"), beside PyTorch
# + transformers padded to the longest (tools/reference/torch_sft_reference.py, the same model:
# it reads the model section of accel-train's effective config, --print-config). All
# report trained tokens/s (the completion tokens whose loss counts): accel-train's metrics.jsonl
# tokens_per_s, median over the steps after the first 5, with those steps' time (median, p90,
# min: a step at a new row length is an outlier) and host busy/wait per step.
#
#   tools/reference/sft_bench.sh [SIZE] [STEPS]   (SIZE: configs/SIZE.yaml, default llama-1b;
#                                                  e.g. qwen3-0.6b, llama-3.2-1b)
#
# Environment: PACKED_MBS (rows of seq_len per step, default 4), PADDED_MBS (samples per step
# unpacked, accel-train and torch alike, default 8), PAD_MULTIPLE (default 64), SAMPLES (default
# 4000), OUT (default out/sft_bench). Prints one JSON line per run and a summary line.
set -euo pipefail
cd "$(dirname "$0")/../.."
size="${1:-llama-1b}"
steps="${2:-30}"
out="${OUT:-out/sft_bench}"
packed_mbs="${PACKED_MBS:-4}"
padded_mbs="${PADDED_MBS:-8}"
pad_multiple="${PAD_MULTIPLE:-64}"
# Fail before any GPU time is spent: the config, the binary, torch's side.
[ -f "configs/$size.yaml" ] || { echo "no configs/$size.yaml (SIZE names a file there)" >&2; exit 2; }
[ -x build/bin/accel-train ] || { echo "no build/bin/accel-train: build it first" >&2; exit 2; }
python3 -c "import torch, transformers, yaml" || { echo "torch_sft_reference.py needs torch, transformers and yaml" >&2; exit 2; }
mkdir -p "$out"
# The model torch builds: accel-train's effective config of configs/$size.yaml (every model key
# filled in), checked on the meta device now, before any GPU time is spent.
build/bin/accel-train --config "configs/$size.yaml" --print-config > "$out/model_config.yaml"
python3 tools/reference/torch_sft_reference.py --check "$out/model_config.yaml"
data="$out/sft_bench.jsonl"
python3 tools/reference/make_sft_bench_data.py "$data" "${SAMPLES:-4000}" 2048

run_accel() {  # $1 = name, then --set overrides
  local name="$1"
  shift
  rm -rf "$out/$name"
  env ${RUN_ENV:-} build/bin/accel-train --config "configs/$size.yaml" --output-dir "$out/$name" \
    --set data.source=jsonl --set "data.jsonl_files=[$data]" --set data.tokenizer=byte \
    --set data.format=prompt_completion --set data.eval_fraction=0 --set data.overlong=truncate \
    --set training.max_steps="$steps" --set training.log_every=1 --set training.progress=plain \
    --set training.sample_tokens=0 --set training.eval_every=0 --set checkpoint.at_end=false "$@" \
    > "$out/$name.log" 2>&1 || { tail -20 "$out/$name.log"; exit 1; }
  python3 - "$out/$name/metrics.jsonl" "$name" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = [l for l in lines if "step" in l and "tokens_per_s" in l and not l.get("summary")][5:]
summary = [l for l in lines if l.get("summary")][0]
# Step times from elapsed_s (log_every 1): a step of a new row length also tunes GEMMs and builds
# attention plans, so padded runs show slow outliers (p90) that a bounded set of lengths removes.
all_steps = [l for l in lines if "step" in l and "elapsed_s" in l and not l.get("summary")]
ms = sorted((b["elapsed_s"] - a["elapsed_s"]) * 1e3 for a, b in zip(all_steps[4:], all_steps[5:]))
def med(key):  # host_busy_ms_per_step is split by part (forward/backward, optimizer, ...): its sum
    v = [sum(l[key].values()) if isinstance(l[key], dict) else l[key] for l in steps if key in l]
    return round(statistics.median(v), 1) if v else None
print(json.dumps({"run": sys.argv[2],
                  "trained_tokens_per_s": round(statistics.median(l["tokens_per_s"] for l in steps)),
                  "step_ms_median": round(statistics.median(ms), 1),
                  "step_ms_p90": round(ms[int(0.9 * (len(ms) - 1))], 1),
                  "step_ms_min": round(ms[0], 1),
                  "host_busy_ms_per_step_median": med("host_busy_ms_per_step"),
                  "host_wait_ms_per_step_median": med("host_wait_ms_per_step"),
                  "trained_fraction": round(summary["trained_fraction"], 3),
                  "peak_mem_gib": round(max(l["peak_mem_bytes"] for l in steps) / 2**30, 2),
                  "loss_last": round(steps[-1]["loss"], 3)}))
PY
}

run_accel accel_packed --set data.packing=true --set training.micro_batch_size="$packed_mbs" | tee "$out/results.jsonl"
run_accel accel_padded --set data.packing=false --set training.micro_batch_size="$padded_mbs" | tee -a "$out/results.jsonl"
run_accel accel_padded_pad"$pad_multiple" --set data.packing=false --set training.micro_batch_size="$padded_mbs" \
  --set data.pad_to_multiple_of="$pad_multiple" | tee -a "$out/results.jsonl"
# Padded again with the GEMMs' heuristic choice only (no timing of candidates per new shape):
# what is left of the gap to the pad-to-multiple run is cuDNN's per-length attention graphs and
# allocator growth.
RUN_ENV=ACCEL_GEMM_TUNING=0 run_accel accel_padded_notune --set data.packing=false \
  --set training.micro_batch_size="$padded_mbs" | tee -a "$out/results.jsonl"
python3 tools/reference/torch_sft_reference.py "$data" "$out/model_config.yaml" "$padded_mbs" "$steps" \
  | tee -a "$out/results.jsonl"
python3 - "$out/results.jsonl" "accel_padded_pad$pad_multiple" <<'PY'
import json, sys
r = {}
for l in open(sys.argv[1]):
    j = json.loads(l)
    r[j["run"]] = j["trained_tokens_per_s"]
p = sys.argv[2]
print(json.dumps({"summary": "trained tokens/s", **r,
                  "packed_over_padded": round(r["accel_packed"] / r["accel_padded"], 2),
                  p + "_over_padded": round(r[p] / r["accel_padded"], 2),
                  "notune_over_padded": round(r["accel_padded_notune"] / r["accel_padded"], 2),
                  "accel_padded_over_torch_padded": round(r["accel_padded"] / r["torch_padded"], 2),
                  p + "_over_torch_padded": round(r[p] / r["torch_padded"], 2),
                  "accel_packed_over_torch_padded": round(r["accel_packed"] / r["torch_padded"], 2)}))
PY
