#!/usr/bin/env python3
"""The PyTorch reference for accel-train's SFT throughput: a transformers causal LM of the same
shape as the accel-train run (SDPA attention, bf16 autocast over fp32 weights, fused AdamW)
fine-tuned on a prompt/completion JSONL the way a padded Trainer batch is made: samples tokenized
as bytes (accel-train's data.tokenizer byte), cut to SEQ tokens, shuffled (seed 0), BATCH per
step, padded on the right to the longest in the batch, attention_mask 0 and labels -100 on the
padding and the prompt. Prints one JSON line: trained_tokens_per_s (the tokens whose loss
counts), positions_per_s (padded positions), step_ms, trained_fraction, peak_mem_gib,
loss_first, loss_last. Run it in the same GPU call as accel-train (tools/reference/sft_bench.sh
does both).

    python3 tools/reference/torch_sft_reference.py SFT.jsonl [MODEL] [BATCH] [STEPS] [SEQ]
    python3 tools/reference/torch_sft_reference.py --check MODEL   (builds it on the meta device)

MODEL is the config.yaml an accel-train run wrote into its output folder (the effective
configuration, every model key filled in): its model section gives the shape and family (llama ->
LlamaConfig, qwen3 -> Qwen3Config with its per-head q/k norms, qwen2, mistral), rope scaling,
head_dim and tie_word_embeddings included, and training.seq_len the default SEQ; so the two sides
cannot drift apart. MODEL may also be a size of llama_shapes.py (llama-125m, llama-1b,
llama-8b: untied Llama), the default llama-1b.
"""
import json
import os
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


# accel-train's model.name -> the transformers classes of that family.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

# Model keys of accel-train's config.yaml that are config.json fields of the same name and
# meaning, with their types (YAML may read 1e-06 as a string; transformers 5 checks types).
INT, FLOAT, BOOL, ANY = int, float, bool, None
SAME_FIELDS = {
    "hidden_size": INT, "num_hidden_layers": INT, "num_attention_heads": INT,
    "intermediate_size": INT, "vocab_size": INT, "max_position_embeddings": INT,
    "rms_norm_eps": FLOAT, "initializer_range": FLOAT, "tie_word_embeddings": BOOL,
    "attention_bias": BOOL, "hidden_act": ANY, "mlp_bias": BOOL, "attention_dropout": FLOAT,
    "sliding_window": INT, "use_sliding_window": BOOL, "max_window_layers": INT,
    "layer_types": ANY,
}
# Fields only some families' configs have (accel-train writes every key for every family).
WINDOWED = ("qwen2", "qwen3", "mistral")
FAMILY_ONLY = {"mlp_bias": ("llama",), "sliding_window": WINDOWED,
               "use_sliding_window": ("qwen2", "qwen3"), "max_window_layers": ("qwen2", "qwen3"),
               "layer_types": ("qwen2", "qwen3")}
# What must come out of the built config exactly as asked (the shape that is timed).
CHECKED = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings"]


def typed(kind, v):
    if kind is BOOL:
        if isinstance(v, str):
            return v.strip().lower() in ("true", "yes", "on")
        return bool(v)
    return kind(v) if kind else v


def accel_model(path):
    """(model.name, config.json fields, rope (rope_theta, rope_scaling or None), training.seq_len)
    of the config.yaml an accel-train run wrote."""
    import yaml

    with open(path) as f:
        cfg = yaml.safe_load(f)
    m = cfg.get("model") or {}
    name = m.get("name") or "llama"
    if name not in FAMILIES:
        raise SystemExit(f"{path}: model.name {name!r} has no transformers class here; "
                         f"known: {', '.join(FAMILIES)}")
    if m.get("init_from"):
        raise SystemExit(f"{path}: model.init_from is set; this reference trains a random init")
    fields = {}
    for k, kind in SAME_FIELDS.items():
        if k in FAMILY_ONLY and name not in FAMILY_ONLY[k]:
            continue
        if m.get(k) not in (None, [], {}, ""):  # empty: transformers' own default
            fields[k] = typed(kind, m[k])
    # 0 means "derived" in accel-train, as absent does in transformers; give them explicitly.
    heads = fields["num_attention_heads"]
    fields["num_key_value_heads"] = int(m.get("num_key_value_heads") or heads)
    fields["head_dim"] = int(m.get("head_dim") or fields["hidden_size"] // heads)
    if not fields.get("sliding_window"):
        fields.pop("sliding_window", None)  # 0 = none in accel-train; transformers wants null
    rope = dict(m.get("rope_scaling") or m.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", m.get("rope_theta", 10000.0)))
    if "type" in rope:  # the older spelling of rope_type
        rope.setdefault("rope_type", rope.pop("type"))
    scaling = None
    if rope.get("rope_type", "default") != "default":
        scaling = {k: v if k == "rope_type" or isinstance(v, (bool, list)) else
                   int(v) if k == "original_max_position_embeddings" else float(v)
                   for k, v in rope.items()}
    seq = int((cfg.get("training") or {}).get("seq_len", 2048))
    return name, fields, (theta, scaling), seq


def family_config(name, fields, rope):
    """The transformers config of the family (Qwen3Config, LlamaConfig, ...), rope given the way
    the installed version takes it (5.x: rope_parameters; 4.x: rope_theta + rope_scaling)."""
    import inspect

    import transformers

    cls = getattr(transformers, FAMILIES[name][0])
    theta, scaling = rope
    fields = dict(fields)
    if int(transformers.__version__.split(".")[0]) >= 5:
        fields["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    else:
        fields["rope_theta"] = theta
        if scaling:
            fields["rope_scaling"] = scaling
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        dropped = [k for k in fields if k not in params]
        if any(k in CHECKED for k in dropped):
            raise SystemExit(f"{cls.__name__} takes none of {dropped}")
        fields = {k: v for k, v in fields.items() if k in params}
    cfg = cls(**fields)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(spec, device="cpu"):
    """The model (its parameters on `device`: "meta" allocates nothing), the default SEQ and the
    JSON fields naming it: SPEC is an accel-train config.yaml or a llama_shapes.py size."""
    with torch.device(device):
        return _build_model(spec)


def _build_model(spec):
    import transformers

    if spec.endswith((".yaml", ".yml")) or os.path.sep in spec:
        name, fields, rope, seq = accel_model(spec)
        cfg = family_config(name, fields, rope)
        model = getattr(transformers, FAMILIES[name][1])(cfg)
        # The timed shape must be the one asked for: a silently dropped field would change it.
        got = {k: getattr(cfg, k, None) for k in CHECKED}
        got["head_dim"] = got["head_dim"] or cfg.hidden_size // cfg.num_attention_heads
        got["tie_word_embeddings"] = (model.get_output_embeddings().weight
                                      is model.get_input_embeddings().weight)
        want = {k: fields.get(k, False if k == "tie_word_embeddings" else None) for k in CHECKED}
        if got != want:
            raise SystemExit(f"{spec}: built {type(cfg).__name__} {got}, asked {want}")
        if name == "qwen3" and not hasattr(model.model.layers[0].self_attn, "q_norm"):
            raise SystemExit(f"{spec}: the Qwen3 model has no per-head q/k norms")
        return model, seq, {"model": name, "config_class": type(cfg).__name__, "config": spec,
                            "params": sum(p.numel() for p in model.parameters())}
    shape = shape_named(spec)
    model = transformers.LlamaForCausalLM(hf_llama_config(shape))
    return model, shape.seq, {"size": spec, "params": sum(p.numel() for p in model.parameters())}


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if sys.argv[1] == "--check":  # build MODEL on the meta device only: fails fast, no GPU
        if len(sys.argv) != 3:
            raise SystemExit("usage: torch_sft_reference.py --check MODEL")
        _, seq, named = build_model(sys.argv[2], "meta")
        print(json.dumps({"check": "ok", **named, "seq": seq}), flush=True)
        return
    path = sys.argv[1]
    spec = sys.argv[2] if len(sys.argv) > 2 else "llama-1b"
    bsz = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 20

    torch.manual_seed(0)
    model, default_seq, named = build_model(spec)
    seq = int(sys.argv[5]) if len(sys.argv) > 5 else default_seq
    model = model.cuda()
    data = samples(path, seq)
    random.Random(0).shuffle(data)
    need = (WARMUP_STEPS + steps) * bsz
    if len(data) < need:
        raise SystemExit(f"{path}: {len(data)} samples, {need} needed")
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
        "run": "torch_padded", **named, "batch": bsz, "seq": seq, "steps": steps,
        "trained_tokens_per_s": round(trained / dt), "positions_per_s": round(positions / dt),
        "step_ms": round(dt / steps * 1e3, 1), "trained_fraction": round(trained / positions, 3),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "loss_first": round(losses[0], 3), "loss_last": round(losses[-1], 3),
    }), flush=True)


if __name__ == "__main__":
    main()
