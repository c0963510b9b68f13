#!/usr/bin/env python3
"""Reads a run's TensorBoard files with the tensorboard package and compares every scalar with
metrics.jsonl (each value as float32, since TensorBoard stores simple_value as a float).

    python3 tools/reference/check_tensorboard.py OUTPUT_DIR

Prints one line per tag and exits 1 when a value is missing, extra or different.
"""
import json
import math
import struct
import sys
from pathlib import Path

from tensorboard.backend.event_processing import event_accumulator


def as_f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def expected_scalars(metrics_path):
    want = {}  # tag -> {step: value}

    def walk(obj, prefix, step):
        for key, value in obj.items():
            tag = f"{prefix}/{key}" if prefix else key
            if isinstance(value, dict):
                walk(value, tag, step)
            elif isinstance(value, bool) or value is None or isinstance(value, str):
                continue
            elif isinstance(value, (int, float)) and not (prefix == "" and key == "step"):
                want.setdefault(tag, {})[step] = as_f32(float(value))

    for line in Path(metrics_path).read_text().splitlines():
        obj = json.loads(line)
        if isinstance(obj.get("step"), int) and not isinstance(obj.get("step"), bool):
            walk(obj, "", obj["step"])
    return want


def main():
    out = Path(sys.argv[1])
    want = expected_scalars(out / "metrics.jsonl")
    acc = event_accumulator.EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    got_tags = set(acc.Tags()["scalars"])
    bad = 0
    for tag in sorted(set(want) | got_tags):
        got = {e.step: e.value for e in acc.Scalars(tag)} if tag in got_tags else {}
        exp = want.get(tag, {})
        same = got.keys() == exp.keys() and all(
            (math.isnan(got[s]) and math.isnan(exp[s])) or got[s] == exp[s] for s in exp)
        bad += not same
        print(f"{'ok  ' if same else 'DIFF'} {tag}: {len(got)} values read, {len(exp)} in metrics.jsonl")
    total = sum(len(v) for v in want.values())
    print(f"tensorboard check: {len(want)} tags, {total} scalars, {bad} tags differ")
    sys.exit(1 if bad or not want else 0)


if __name__ == "__main__":
    main()
