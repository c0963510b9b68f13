#!/usr/bin/env python3
"""A synthetic prompt/completion JSONL for the SFT throughput benchmark (tools/reference/
sft_bench.sh): N samples of lowercase words whose lengths in bytes (= tokens under
data.tokenizer byte) follow log-normal distributions shaped like instruction-tuning sets (prompts
median ~120 tokens, completions median ~250, each sample at most MAX tokens). Seeded; no
downloads, no third-party packages.

    python3 tools/reference/make_sft_bench_data.py OUT.jsonl [N] [MAX]
"""
import json
import math
import random
import sys


def words(rng, n):
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append("".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(2, 9))))
    return " ".join(out)[:n]


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 4000
    longest = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            p = max(8, int(rng.lognormvariate(math.log(120), 0.8)))
            c = max(8, int(rng.lognormvariate(math.log(250), 0.8)))
            if p + c > longest:  # keep both parts, scaled to fit
                p, c = max(4, p * longest // (p + c)), max(4, c * longest // (p + c))
                c = min(c, longest - p)
            f.write(json.dumps({"prompt": words(rng, p - 1) + "\n", "completion": words(rng, c)}) + "\n")


if __name__ == "__main__":
    main()
