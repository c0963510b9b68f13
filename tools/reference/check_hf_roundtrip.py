#!/usr/bin/env python3
"""Checks that model folders written by accel-train load in Hugging Face transformers and give the
same logits: for each folder (a checkpoint out/NAME/checkpoints/step_N, a final model, or an
`accel-checkpoint consolidate` output), a random batch of token ids is written to
batch.safetensors, `accel-logits` computes our fp32 logits from the folder, transformers'
AutoModelForCausalLM.from_pretrained loads the same folder in float32 (eager attention) and
computes its logits, and the two are compared. Needs torch, transformers and safetensors.

    python3 tools/reference/check_hf_roundtrip.py DIR [DIR ...] [--bin build/bin]
        [--batch 2] [--seq 64] [--seed 0] [--tol 1e-4] [--device cpu|cuda]

Prints one JSON line per folder (folder, model_type, architectures, transformers class,
max_rel_error = max|ours - theirs| / max|theirs|, ok) and exits 1 when a folder fails (or
transformers loads it as another class than config.json's architectures names).

Folders of each family, e.g. (random init, a few steps on synthetic tokens, on the H200):

    for m in llama-3.2-1b qwen3-0.6b qwen2.5-1.5b mistral-7b; do
      build/bin/accel-train --config configs/$m.yaml --output-dir out/rt-$m \\
        --set model.num_hidden_layers=2 --set training.max_steps=3 \\
        --set checkpoint.at_end=true --set training.seq_len=256 --set training.micro_batch_size=2
    done
    python3 tools/reference/check_hf_roundtrip.py out/rt-*/checkpoints/step_3 --seq 256
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def check_folder(folder, args):
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    vocab = int(config["vocab_size"])
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen, dtype=torch.int64)
    with tempfile.TemporaryDirectory() as tmp:
        batch_path = os.path.join(tmp, "batch.safetensors")
        logits_path = os.path.join(tmp, "logits.safetensors")
        save_file({"input_ids": ids}, batch_path)
        subprocess.run([os.path.join(args.bin, "accel-logits"), "--model", folder, "--batch",
                        batch_path, "--out", logits_path, "--device", args.device], check=True)
        ours = load_file(logits_path)["logits"].double()

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    device = torch.device(args.device)
    model.to(device)
    with torch.no_grad():
        theirs = model(input_ids=ids.to(device)).logits.double().cpu()
    rel = ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()
    cls = type(model).__name__
    want_cls = (config.get("architectures") or [None])[0]
    ok = rel <= args.tol and cls == want_cls
    return dict(folder=folder, model_type=config.get("model_type"), architectures=want_cls,
                transformers_class=cls, transformers=transformers.__version__,
                seq=args.seq, max_rel_error=rel, ok=ok)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+")
    p.add_argument("--bin", default=os.path.join(REPO, "build", "bin"),
                   help="folder holding accel-logits (default: build/bin)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where both sides compute (fp32 either way)")
    args = p.parse_args()
    failed = 0
    for folder in args.folders:
        r = check_folder(folder, args)
        print(json.dumps(r), flush=True)
        failed += not r["ok"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
