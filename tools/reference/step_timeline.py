#!/usr/bin/env python3
"""Where a training step's wall time goes, from a CUPTI trace (tools/profile/kernel_trace.cpp):

    CUDA_INJECTION64_PATH=build/lib/libaccel_kernel_trace.so ACCEL_TRACE_OUT=trace.csv \\
        build/bin/accel-train --config configs/llama-1b.yaml --set training.max_steps=12
    python3 tools/reference/step_timeline.py trace.csv [--steps 5] [--kernels 30]

A step runs from one forward embedding lookup (`embedding_kernel`) to the next; the last
--steps whole steps are read (with gradient accumulation, or evaluation in the window, these are
micro-batches or evaluation batches: trace plain steps). For each step: the wall time, the time the GPU was running
something, and the time it was idle, split by why:
  - host late, after a wait: the GPU ran dry while the launching thread was blocked in a
    synchronizing call (a stream synchronize, a blocking copy: a loss or norm read) and had not
    launched the next work yet (a wait that polls, as the NCCL process group's does, counts as
    launching);
  - host late, launching: the host was busy (no wait) and launched the next work after the GPU
    had finished the previous one: the host is slower than the GPU there;
  - queued: the next work was launched before the GPU went idle; the gap is the GPU's own
    latency between launches.
Then the kernel time by kind (step_kernels.py's kinds), the largest idle gaps with the
kernels on either side and the host call that preceded the late launch, and with --kernels N the
N kernels (and copies) that take the most time, with their launches and mean time.
"""
import bisect
import csv
import re
import statistics
import subprocess
import sys
from collections import defaultdict

sys.path.insert(0, __import__("os").path.dirname(__file__))
from step_kernels import STEP_START, kind_of  # noqa: E402

WAITS = re.compile(r"Synchronize|cudaMemcpy(?!.*Async)|cuMemcpy[DH]to[DH](?!.*Async)")
GPU_KINDS = {"K", "C", "S"}


def demangled(names):
    """{mangled: readable} through c++filt when it is installed (binutils), else names as they are."""
    names = sorted(set(names))
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}
    return dict(zip(names, out)) if len(out) >= len(names) else {n: n for n in names}


def read(path):
    """-> GPU records (start, end, correlation, name) and host calls (start, end, correlation,
    name, thread), each sorted by start."""
    gpu, api = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rec = (int(row["start_ns"]), int(row["end_ns"]), int(row["correlation"]), row["name"])
            if row["kind"] in GPU_KINDS:
                gpu.append(rec)
            else:  # older traces have no thread: one thread
                api.append(rec + (int(row.get("stream_or_thread") or 0),))
    readable = demangled(g[3] for g in gpu)
    gpu = sorted((s, e, c, readable[n]) for s, e, c, n in gpu)
    api.sort()
    return gpu, api


def short(name):
    name = re.sub(r"^void |\(anonymous namespace\)::", "", name)
    name = re.sub(r"\(.*", "", name)  # drop the parameter list
    name = re.sub(r"<.*", "", name)  # and template arguments
    return name.split("::")[-1][:48] or "?"


def main():
    args = sys.argv[1:]
    want, top = 5, 0
    for flag in ("--steps", "--kernels"):
        if flag in args:
            i = args.index(flag)
            if flag == "--steps":
                want = int(args[i + 1])
            else:
                top = int(args[i + 1])
            del args[i:i + 2]
    if len(args) != 1:
        sys.exit(__doc__)
    gpu, api = read(args[0])
    launch = {}  # correlation -> (start, thread) of the host call that launched it
    calls, waits = defaultdict(list), defaultdict(list)  # thread -> its calls / its waits
    for s, e, c, n, th in api:
        launch.setdefault(c, (s, th))
        calls[th].append((s, n))
        if WAITS.search(n):
            waits[th].append((e, s))  # by end: one thread's waits do not overlap
    wait_ends = {th: [w[0] for w in ws] for th, ws in waits.items()}
    call_starts = {th: [x[0] for x in xs] for th, xs in calls.items()}

    def waited(th, idle_from, issued):
        """Whether thread th was blocked in a wait between the GPU going idle and the launch."""
        k = bisect.bisect_right(wait_ends.get(th, []), idle_from)
        return k < len(waits[th]) and waits[th][k][1] < issued

    starts = [i for i, g in enumerate(gpu) if STEP_START.search(g[3])]
    if len(starts) < 2:
        sys.exit(f"need two forward embedding launches, found {len(starts)}: run more steps")
    bounds = list(zip(starts, starts[1:]))[-want:]
    rows, gaps, by_kind = [], defaultdict(float), defaultdict(float)
    by_name = defaultdict(lambda: [0.0, 0.0])  # name -> [ns, launches] per step
    for a, b in bounds:
        t0, t1 = gpu[a][0], gpu[b][0]
        busy = late_wait = late_busy = queued = 0
        end = t0
        for i in range(a, b + 1):
            s, e, c, n = gpu[i]
            gap = s - end
            if gap > 0:
                issued, th = launch.get(c, (end, None))  # no launch record: counted as queued
                if issued > end:  # the host launched it after the GPU had gone idle
                    blocked = waited(th, end, issued)
                    if blocked:
                        late_wait += min(gap, issued - end)
                    else:
                        late_busy += min(gap, issued - end)
                    queued += max(0, gap - (issued - end))
                    # The launching thread's call before the launch.
                    at = bisect.bisect_left(call_starts[th], issued) - 1
                    host = short(calls[th][at][1]) if at >= 0 else "?"
                    key = (short(gpu[i - 1][3]), short(n), "after a wait" if blocked else host)
                else:
                    queued += gap
                    key = (short(gpu[i - 1][3]), short(n), "queued")
                gaps[key] += gap / len(bounds)
            if i < b:
                busy += max(0, e - max(s, end))
                by_kind[kind_of(n)] += (e - s) / len(bounds)
                by_name[n][0] += (e - s) / len(bounds)
                by_name[n][1] += 1 / len(bounds)
            end = max(end, e)
        rows.append((t1 - t0, busy, late_wait, late_busy, queued))

    def ms(ns):
        return ns / 1e6

    med = [statistics.median(col) for col in zip(*rows)]
    print(f"# {len(rows)} steps (median ms per step)")
    print("| wall | GPU busy | idle: host late after a wait | idle: host late, launching | "
          "idle: queued |")
    print("|---|---|---|---|---|")
    print("| " + " | ".join(f"{ms(v):.2f}" for v in med) + " |")
    print("\n| kernel kind | ms per step |\n|---|---|")
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {ms(v):.2f} |")
    print("\n| idle gap: before -> after (host call before the late launch) | ms per step |")
    print("|---|---|")
    for (p, n, h), v in sorted(gaps.items(), key=lambda kv: -kv[1])[:15]:
        print(f"| {p} -> {n} ({h}) | {ms(v):.3f} |")
    if top:
        print("\n| kernel | ms per step | launches | us each |\n|---|---|---|---|")
        for n, (t, k) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"| {short(n)} | {ms(t):.2f} | {k:.0f} | {t / k / 1e3:.1f} |")


if __name__ == "__main__":
    main()
