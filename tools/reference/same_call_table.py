#!/usr/bin/env python3
"""The same-call table of accel-train against PyTorch, from the files same_call_bench.sh writes
into one folder (one GPU call):

    python3 tools/reference/same_call_table.py DIR

DIR holds, per benchmark size (llama-125m, llama-1b, llama-8b, ...):
  accel_SIZE_rK.json        accel-bench --json of round K (1, 2, ...): its "single" rows, one per
                            precision (bf16, fp8)
  torch_SIZE_VARIANT.json   torch_reference.py's JSON line for that variant (bf16, bf16-compile,
                            fp8-compile, or those with -ckpt); a missing or empty file is a run
                            that did not finish, shown as "-"

Prints one markdown row per size: accel-train's tokens/s for each round and their mean, its
peak memory, PyTorch's tokens/s and peak for each variant, and the ratios of the means (bf16 over
eager and compile, fp8 over fp8-compile). A ratio only divides numbers of the same folder, so of
the same call. No third-party modules: runs wherever python3 does.
"""
import glob
import json
import os
import re
import sys

GIB = 1024.0**3


def read_accel(path):
    """{precision: (tokens_per_s, peak GiB)} of an accel-bench JSON file's single-process rows."""
    with open(path) as f:
        rows = json.load(f)
    out = {}
    for row in rows:
        if row.get("strategy") != "single" or row.get("status") != "ok":
            continue
        out[row["precision"]] = (float(row["tokens_per_s"]), row["peak_bytes_max_rank"] / GIB)
    return out


def read_torch(path):
    """(tokens_per_s, peak GiB) of torch_reference.py's last JSON line, or None."""
    try:
        with open(path) as f:
            lines = [line for line in f if line.lstrip().startswith("{")]
    except OSError:
        return None
    if not lines:
        return None
    row = json.loads(lines[-1])
    return float(row["tokens_per_s"]), float(row["peak_mem_gib"])


def fmt_int(x):
    return "-" if x is None else f"{x:,.0f}"


def ratio(a, b):
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}x"


def variant_kind(variant):
    """'eager', 'compile' or 'fp8-compile' of a torch_reference.py variant name."""
    base = variant[: -len("-ckpt")] if variant.endswith("-ckpt") else variant
    return {"bf16": "eager", "bf16-compile": "compile", "fp8-compile": "fp8-compile"}.get(base)


def sizes_in(folder):
    names = set()
    for p in glob.glob(os.path.join(folder, "accel_*_r*.json")):
        m = re.match(r"accel_(.+)_r\d+\.json$", os.path.basename(p))
        if m:
            names.add(m.group(1))
    order = {"llama-125m": 0, "llama-1b": 1, "llama-8b": 2}
    return sorted(names, key=lambda s: (order.get(s, 9), s))


def table(folder):
    lines = [
        "| size | accel-train bf16 tok/s (rounds; mean), peak | fp8 tok/s (rounds; mean), peak "
        "| PyTorch eager | compile | fp8-compile | bf16 / eager | bf16 / compile "
        "| fp8 / fp8-compile |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in sizes_in(folder):
        rounds = sorted(glob.glob(os.path.join(folder, f"accel_{size}_r*.json")),
                        key=lambda p: int(re.search(r"_r(\d+)\.json$", p).group(1)))
        per_round = [read_accel(p) for p in rounds]
        accel = {}
        for precision in ("bf16", "fp8"):
            runs = [r[precision] for r in per_round if precision in r]
            if runs:
                mean = sum(t for t, _ in runs) / len(runs)
                text = " / ".join(fmt_int(t) for t, _ in runs)
                text += f"; {fmt_int(mean)}, {max(p for _, p in runs):.1f} GiB"
                accel[precision] = (mean, text)
        torch = {}
        for path in glob.glob(os.path.join(folder, f"torch_{size}_*.json")):
            variant = os.path.basename(path)[len(f"torch_{size}_"):-len(".json")]
            kind = variant_kind(variant)
            if kind:
                torch[kind] = (variant, read_torch(path))

        def torch_cell(kind):
            if kind not in torch:
                return "not run"
            variant, result = torch[kind]
            if result is None:
                return f"{variant}: did not finish"
            return f"{variant} {fmt_int(result[0])}, {result[1]:.1f} GiB"

        def tok(kind):
            result = torch.get(kind, (None, None))[1]
            return None if result is None else result[0]

        bf16 = accel.get("bf16", (None, "-"))
        fp8 = accel.get("fp8", (None, "-"))
        lines.append(
            f"| {size} | {bf16[1]} | {fp8[1]} | {torch_cell('eager')} | {torch_cell('compile')} "
            f"| {torch_cell('fp8-compile')} | {ratio(bf16[0], tok('eager'))} "
            f"| {ratio(bf16[0], tok('compile'))} | {ratio(fp8[0], tok('fp8-compile'))} |")
    return "\n".join(lines)


def main():
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: same_call_table.py DIR (the folder same_call_bench.sh wrote)")
    if not sizes_in(sys.argv[1]):
        sys.exit(f"same_call_table.py: no accel_SIZE_rK.json files in {sys.argv[1]}")
    print(table(sys.argv[1]))


if __name__ == "__main__":
    main()
