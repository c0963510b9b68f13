#!/usr/bin/env python3
"""The PyTorch reference for accel-train's SFT throughput: transformers' LlamaForCausalLM
(llama_shapes.py's shape, SDPA attention, bf16 autocast over fp32 weights, fused AdamW) fine-tuned
on a prompt/completion JSONL the way a padded Trainer batch is made: samples tokenized as bytes
(accel-train's data.tokenizer byte), cut to SEQ tokens, shuffled (seed 0), BATCH per step, padded
on the right to the longest in the batch, attention_mask 0 and labels -100 on the padding and the
prompt. Prints one JSON line: trained_tokens_per_s (the tokens whose loss counts), positions_per_s
(padded positions), step_ms, trained_fraction, peak_mem_gib, loss_first, loss_last. Run it in the
same GPU call as accel-train (tools/reference/sft_bench.sh does both).

    python3 tools/reference/torch_sft_reference.py SFT.jsonl [SIZE] [BATCH] [STEPS] [SEQ]
"""
import json
import random
import sys
import time

import torch

from llama_shapes import hf_llama_config, shape_named

WARMUP_STEPS = 5


def samples(path, seq):
    out = []
    with open(path) as f:
        for line in f:
            j = json.loads(line)
            prompt, completion = list(j["prompt"].encode()), list(j["completion"].encode())
            ids = (prompt + completion)[:seq]
            labels = ([-100] * len(prompt) + completion)[:seq]
            out.append((ids, labels))
    return out


def batch(rows, device):
    n = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for r, (i, l) in enumerate(rows):
        ids[r, : len(i)] = torch.tensor(i)
        labels[r, : len(l)] = torch.tensor(l)
        mask[r, : len(i)] = 1
    return ids.to(device), labels.to(device), mask.to(device)


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    path = sys.argv[1]
    size = sys.argv[2] if len(sys.argv) > 2 else "llama-1b"
    bsz = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    shape = shape_named(size)
    seq = int(sys.argv[5]) if len(sys.argv) > 5 else shape.seq
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    data = samples(path, seq)
    random.Random(0).shuffle(data)
    need = (WARMUP_STEPS + steps) * bsz
    if len(data) < need:
        raise SystemExit(f"{path}: {len(data)} samples, {need} needed")
    model = LlamaForCausalLM(hf_llama_config(shape)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    losses, trained, positions = [], 0, 0
    torch.cuda.reset_peak_memory_stats()
    for i in range(WARMUP_STEPS + steps):
        if i == WARMUP_STEPS:
            torch.cuda.synchronize()
            t0 = time.time()
        ids, labels, mask = batch(data[i * bsz:(i + 1) * bsz], "cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        if i >= WARMUP_STEPS:
            # Hugging Face shifts the labels: position t predicts labels[t + 1].
            trained += int((labels[:, 1:] != -100).sum())
            positions += ids.numel()
    torch.cuda.synchronize()
    dt = time.time() - t0
    print(json.dumps({
        "size": size, "batch": bsz, "seq": seq, "steps": steps,
        "trained_tokens_per_s": round(trained / dt), "positions_per_s": round(positions / dt),
        "step_ms": round(dt / steps * 1e3, 1), "trained_fraction": round(trained / positions, 3),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "loss_first": round(losses[0], 3), "loss_last": round(losses[-1], 3),
    }), flush=True)


if __name__ == "__main__":
    main()
