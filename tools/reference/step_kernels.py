#!/usr/bin/env python3
"""Where one training step's GPU time goes: sums an Nsight Compute kernel list by kind.

    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \\
        --print-units base --launch-skip 2000 --launch-count 3000 \\
        build/bin/accel-train --config configs/llama-1b.yaml ... > kernels.csv
    python3 tools/reference/step_kernels.py kernels.csv [--step-ms 129.4]

One step is the kernels from one forward embedding lookup (`embedding_kernel`) to the next, so
the launch window must hold two of them. Prints a table (ms per step, share, launches) and, with
--step-ms (the measured wall time of a step), the time outside kernels: launch gaps and waits on
the host. The kinds are matched on kernel names; "other" lists its largest kernels by name so
that a new kernel is seen, not hidden.
"""
import csv
import re
import sys
from collections import defaultdict

# (kind, pattern on the lowercased kernel name), first match wins.
KINDS = [
    ("attention", r"cudnn|flash|fmha|attn|sdpa"),
    ("GEMM", r"gemm|xmma|cutlass|nvjet|gemv|splitk"),
    ("optimizer (AdamW, grad norm)", r"adamw|sgd|sumsq|sum_of_squares|norm_sq|clip"),
    ("fp8 casts and amax", r"fp8|amax|quant"),
    ("rms_norm", r"rms"),
    ("swiglu", r"swiglu"),
    ("rope", r"rope"),
    ("cross-entropy", r"cross_entropy|xent|logsumexp|softmax"),
    ("embedding", r"embedding|make_keys"),
    ("copies and elementwise", r"copy|map|binary|unary|fill|cast|add|scale|accumulate"),
]


# A step's first kernel, the forward embedding lookup, by its name mangled or not:
# "...16embedding_kernelI..." or "void accel::...::embedding_kernel<...>(...)"; never
# embedding_backward_kernel.
STEP_START = re.compile(r"(?<![A-Za-z_])embedding_kernel(?!_)")


def kind_of(name):
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def read_kernels(path):
    """-> [(kernel name, ns)] in launch order."""
    out = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # skip ncu's own log lines
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        out.append((row["Kernel Name"], float(row["Metric Value"].replace(",", ""))))
    return out


def one_step(kernels):
    starts = [i for i, (name, _) in enumerate(kernels) if STEP_START.search(name)]
    if len(starts) < 2:
        sys.exit(f"need two forward embedding launches in the window, found {len(starts)}: "
                 "widen --launch-count")
    return kernels[starts[0]:starts[1]]


def main():
    args = sys.argv[1:]
    step_ms = None
    if "--step-ms" in args:
        i = args.index("--step-ms")
        step_ms = float(args[i + 1])
        del args[i:i + 2]
    if len(args) != 1:
        sys.exit(__doc__)
    step = one_step(read_kernels(args[0]))
    total = sum(ns for _, ns in step) / 1e6
    by_kind = defaultdict(lambda: [0.0, 0])
    other = defaultdict(float)
    for name, ns in step:
        k = kind_of(name)
        by_kind[k][0] += ns / 1e6
        by_kind[k][1] += 1
        if k == "other":
            other[name.split("(")[0][:90]] += ns / 1e6
    print("| kind | ms per step | share of kernel time | launches |")
    print("|---|---|---|---|")
    for k, (ms, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"| {k} | {ms:.2f} | {100 * ms / total:.1f}% | {n} |")
    print(f"| **all kernels** | **{total:.2f}** | 100% | {len(step)} |")
    if step_ms is not None:
        print(f"wall step {step_ms:.1f} ms: {step_ms - total:.1f} ms outside kernels "
              f"({100 * (step_ms - total) / step_ms:.1f}% of the step)")
    for name, ms in sorted(other.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  other: {ms:.3f} ms {name}")


if __name__ == "__main__":
    main()
