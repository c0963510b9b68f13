#!/usr/bin/env python3
"""Token shards from a second-order Markov source whose entropy rate is known exactly.

A convergence comparison (fp32 against bf16 optimizer state, say) needs data that a model can
learn but cannot memorise in the run, and a floor to measure against. Text corpora small enough
to carry are memorised in a few hundred llama-125m steps; uniform random tokens teach nothing.
This source is neither:

  * every token a has K successors S[a][0..K-1] (distinct, drawn at random once per seed);
  * the next token after (prev, cur) is S[cur][(j + prev % R) % K] with j drawn from the Zipf
    weights p_j ~ 1 / (j + 1): the previous token rotates which successor gets which weight.

Given the last two tokens the next one has entropy H(p) whatever they are, so the source's
entropy rate, the lowest mean loss any model can reach, is exactly H(p) nats per token (1.8158
for K = 8). A model that only looks at the current token cannot tell the rotation apart and stays
above it. Fresh samples never repeat, so a 1,000-step run sees each sequence once.

Writes TRAIN_TOKENS tokens to OUT/train.tok and EVAL_TOKENS to OUT/eval.tok (token shards,
docs/data.md, version 1), from chains generated in parallel and laid end to end (a chain boundary
every CHAIN_LEN tokens is the only break in the dependence). Needs numpy.

  python3 tools/reference/markov_corpus.py OUT [--train-tokens N] [--eval-tokens N]
      [--vocab V] [--successors K] [--rotations R] [--seed S]
"""
import argparse
import math
import os
import struct
import sys

import numpy as np


def successor_table(rng, vocab, k):
    """[vocab, k] distinct successors per token."""
    table = rng.integers(0, vocab, size=(vocab, k), dtype=np.int64)
    while True:
        s = np.sort(table, axis=1)
        dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if not dup.any():
            return table
        table[dup] = rng.integers(0, vocab, size=(int(dup.sum()), k), dtype=np.int64)


def generate(rng, table, probs, rotations, n_tokens, chains):
    """n_tokens from `chains` independent chains, each contiguous in the result."""
    vocab, k = table.shape
    length = -(-n_tokens // chains)
    out = np.empty((chains, length), dtype=np.int64)
    prev = rng.integers(0, vocab, size=chains)
    cur = rng.integers(0, vocab, size=chains)
    cdf = np.cumsum(probs)
    for t in range(length):
        out[:, t] = cur
        j = np.searchsorted(cdf, rng.random(chains) * cdf[-1], side="right")
        j = np.minimum(j, k - 1)
        nxt = table[cur, (j + prev % rotations) % k]
        prev, cur = cur, nxt
    return out.reshape(-1)[:n_tokens]


def write_shard(path, tokens, vocab):
    width = 2 if vocab <= 65536 else 4
    header = b"ACCELTOK" + struct.pack("<IIQQQ", 1, width, len(tokens), vocab, 0)
    header += b"\0" * (64 - len(header))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(tokens.astype("<u2" if width == 2 else "<u4").tobytes())
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for train.tok and eval.tok")
    ap.add_argument("--train-tokens", type=int, default=17_000_000)
    ap.add_argument("--eval-tokens", type=int, default=600_000)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--successors", type=int, default=8)
    ap.add_argument("--rotations", type=int, default=4)
    ap.add_argument("--chains", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    if a.successors < 2 or a.successors > a.vocab or a.rotations < 1 or a.chains < 1:
        sys.exit("markov_corpus: need 2 <= successors <= vocab, rotations >= 1, chains >= 1")
    rng = np.random.default_rng(a.seed)
    table = successor_table(rng, a.vocab, a.successors)
    probs = 1.0 / np.arange(1, a.successors + 1)
    probs /= probs.sum()
    floor = -float((probs * np.log(probs)).sum())
    os.makedirs(a.out, exist_ok=True)
    for name, n in (("train", a.train_tokens), ("eval", a.eval_tokens)):
        tokens = generate(rng, table, probs, a.rotations, n, a.chains)
        write_shard(os.path.join(a.out, name + ".tok"), tokens, a.vocab)
    print(f"markov_corpus: {a.out}/train.tok ({a.train_tokens:,} tokens), {a.out}/eval.tok "
          f"({a.eval_tokens:,}); vocab {a.vocab}, {a.successors} successors, {a.rotations} "
          f"rotations; entropy rate (loss floor) {floor:.4f} nats, uniform {math.log(a.vocab):.4f}")


if __name__ == "__main__":
    main()
