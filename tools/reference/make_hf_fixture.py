#!/usr/bin/env python3
"""Writes the Hugging Face reference fixtures that tests/models/decoder_fixture_test.cpp checks the
C++ model against: a small randomly initialised transformers model, one batch of tokens, the
model's logits, loss and the gradient of every parameter, and the losses of a few AdamW steps on
that batch. Everything runs in float32 on the CPU, so the numbers do not depend on a GPU.
Needs torch, transformers and safetensors; see tests/data/hf/README.md for when and how to run it.

    python3 tools/reference/make_hf_fixture.py --all [--out-root DIR] [--compare DIR]
    python3 tools/reference/make_hf_fixture.py llama_tied_mha [--out-root DIR] [--compare DIR]
    python3 tools/reference/make_hf_fixture.py NEW_NAME --family llama [--heads 8 --kv-heads 8 ...]
    python3 tools/reference/make_hf_fixture.py --list

A fixture folder OUT_ROOT/NAME (default OUT_ROOT: tests/data/hf) holds:
  config.json, generation_config.json, model.safetensors
                         save_pretrained() of the initial model (Hugging Face names)
  batch.safetensors      input_ids int64 [batch, seq]; the labels are the same ids (the model
                         shifts them itself)
  expected.safetensors   logits f32 [batch, seq, vocab], loss f32 [] and grad.<name> f32 for
                         every parameter in named_parameters() (a tied lm_head is not listed), all
                         at the initial weights. Gradients are named as the parameters are in
                         model.safetensors: transformers 5 keeps a mixture-of-experts layer's
                         experts fused (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I])
                         but save_pretrained writes them per expert, so their gradients are split
                         the same way. MoE fixtures also hold aux_loss f32 [] (the router's
                         load-balancing loss; loss includes router_aux_loss_coef * aux_loss)
  train.json             the AdamW settings and the loss before each of --steps AdamW steps on the
                         same batch (torch.optim.AdamW, weight decay on every parameter, constant
                         lr, no clipping)
  rope_sequence.safetensors
                         dynamic-RoPE fixtures only: the logits and the rotary embedding's state
                         after each of a sequence of forwards of varying length on one fresh
                         instance (write_rope_sequence)

--compare DIR compares each written fixture with DIR/NAME: tensor names, shapes and dtypes must
agree, the batch and the initial weights must be equal (same seed, same torch), and the largest
difference of every other tensor and of the losses is printed. It exits with status 1 when
something differs.

Model families: FAMILIES below maps a family name (llama, mistral, qwen2, qwen3, qwen3_moe,
mixtral) to its
transformers classes and a function that turns the shape options into config arguments; FIXTURES
has one or more presets per family (RoPE scalings, biases, q/k norms, sliding windows).
"""
import argparse
import json
import os
import sys

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# Shape and training options with their defaults. A preset changes some of them (and no more:
# it must keep making what tests/data/hf holds); a new fixture takes them from the command line.
DEFAULTS = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=16, batch=2,
                tied=0, rope_theta=10000.0, rms_eps=1e-5, steps=5, lr=1e-3, seed=0,
                # rope: "" (default RoPE) or a JSON object of the scaling parameters, e.g.
                # '{"rope_type": "linear", "factor": 2.0}'; max_pos: max_position_embeddings
                # (0: max(seq, 64)); head_dim: 0 = hidden / heads; window: sliding window (0: none)
                rope="", max_pos=0, head_dim=0, window=0, max_window_layers=0,
                # Mixture of experts (qwen3_moe, mixtral): experts per MoE layer, experts per
                # token, the experts' ffn width (qwen3_moe's moe_intermediate_size; mixtral's
                # experts take --ffn), norm_topk_prob, decoder_sparse_step, mlp_only_layers (a JSON
                # list), router_aux_loss_coef, and the std the routers' weights are drawn with
                # (wider than initializer_range so that no token's k-th and (k+1)-th expert are
                # near a tie, which rounding could break differently in the C++ model).
                experts=0, top_k=2, moe_ffn=0, norm_topk=1, sparse_step=1, mlp_only="[]",
                aux_coef=0.0, router_std=0.1)

# The AdamW settings written to train.json, which the C++ test reads back (its optimizer defaults).
ADAMW = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def rope_args(o):
    """RoPE keyword arguments in the spelling of the installed transformers: transformers 5 takes
    rope_parameters (theta included), 4.x a top-level rope_theta plus rope_scaling."""
    import transformers

    scaling = json.loads(o["rope"]) if o["rope"] else None
    if int(transformers.__version__.split(".")[0]) >= 5:
        params = dict(scaling or {"rope_type": "default"})
        params["rope_theta"] = o["rope_theta"]
        return dict(rope_parameters=params)
    return dict(rope_theta=o["rope_theta"], rope_scaling=scaling)


def common_config_args(o):
    args = dict(hidden_size=o["hidden"], num_hidden_layers=o["layers"],
                num_attention_heads=o["heads"], num_key_value_heads=o["kv_heads"],
                intermediate_size=o["ffn"], vocab_size=o["vocab"],
                max_position_embeddings=o["max_pos"] or max(o["seq"], 64),
                rms_norm_eps=o["rms_eps"], tie_word_embeddings=bool(o["tied"]), **rope_args(o))
    if o["head_dim"]:
        args["head_dim"] = o["head_dim"]
    return args


def llama_config_args(o):
    return dict(common_config_args(o), attention_bias=False, mlp_bias=False)


def mistral_config_args(o):
    # sliding_window None is full attention.
    return dict(common_config_args(o), sliding_window=o["window"] or None)


def qwen2_config_args(o):
    # Qwen2's q/k/v projections always have biases; layers from max_window_layers on use the
    # sliding window when use_sliding_window is set.
    return dict(common_config_args(o), use_sliding_window=bool(o["window"]),
                sliding_window=o["window"] or None, max_window_layers=o["max_window_layers"])


def qwen3_config_args(o):
    # Qwen3: per-head RMSNorm of q and k (q_norm, k_norm), head_dim independent of the width.
    return dict(qwen2_config_args(o), attention_bias=False)


def qwen3_moe_config_args(o):
    # Qwen3-MoE: Qwen3's attention (q/k norms, free head_dim); layer i is sparse unless listed in
    # mlp_only_layers or (i + 1) % decoder_sparse_step != 0, dense layers use intermediate_size.
    # output_router_logits makes the loss include router_aux_loss_coef * aux_loss.
    return dict(common_config_args(o), attention_bias=False, use_sliding_window=False,
                sliding_window=None, num_experts=o["experts"], num_experts_per_tok=o["top_k"],
                moe_intermediate_size=o["moe_ffn"], norm_topk_prob=bool(o["norm_topk"]),
                decoder_sparse_step=o["sparse_step"], mlp_only_layers=json.loads(o["mlp_only"]),
                output_router_logits=True, router_aux_loss_coef=o["aux_coef"])


def mixtral_config_args(o):
    # Mixtral: every layer sparse, experts of width intermediate_size, routing weights always
    # renormalised over the top k; Mistral's sliding window (None: full attention).
    return dict(common_config_args(o), sliding_window=o["window"] or None,
                num_local_experts=o["experts"], num_experts_per_tok=o["top_k"],
                output_router_logits=True, router_aux_loss_coef=o["aux_coef"],
                router_jitter_noise=0.0)


# family -> (config class, model class, options -> config keyword arguments)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", llama_config_args),
    "mistral": ("MistralConfig", "MistralForCausalLM", mistral_config_args),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", qwen2_config_args),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", qwen3_config_args),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", qwen3_moe_config_args),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", mixtral_config_args),
}

# The per-expert tensor names save_pretrained writes (Hub checkpoints' layout), by family:
# (gate, up, down) projections of expert {e}, and the router, under model.layers.{i}.
MOE_DISK_NAMES = {
    "qwen3_moe": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                  "mlp.experts.{e}.down_proj.weight", "mlp.gate.weight"),
    "mixtral": ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                "block_sparse_moe.experts.{e}.w2.weight", "block_sparse_moe.gate.weight"),
}

# The committed fixtures (tests/data/hf/NAME): family and the options that differ from DEFAULTS.
FIXTURES = {
    "llama_default": ("llama", {}),
    # Multi-head attention (as many KV heads as heads) with the LM head tied to the embedding.
    "llama_tied_mha": ("llama", dict(kv_heads=4, tied=1)),
    # Four query heads per KV head, head_dim 8, and Llama 3's rope theta.
    "llama_gqa4_theta": ("llama", dict(heads=8, kv_heads=2, rope_theta=500000.0)),
    # Llama 3.1's RoPE: with head_dim 16 and an original context of 64 the frequencies fall in all
    # three bands of the llama3 rule (kept, smoothed, divided by the factor).
    "llama31_rope": ("llama", dict(rope_theta=500000.0, max_pos=256, rope=json.dumps(
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64}))),
    "llama_rope_linear": ("llama", dict(rope=json.dumps({"rope_type": "linear", "factor": 2.0}))),
    # Dynamic NTK only changes the frequencies past the original context: 16 tokens over 8.
    "llama_rope_dynamic": ("llama", dict(max_pos=8, rope=json.dumps(
        {"rope_type": "dynamic", "factor": 2.0}))),
    "llama_rope_yarn": ("llama", dict(max_pos=64, rope=json.dumps(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
         "beta_fast": 32.0, "beta_slow": 1.0}))),
    # Qwen2.5: q/k/v biases, embeddings tied (as the 0.5B-3B checkpoints have them).
    "qwen2_bias_tied": ("qwen2", dict(tied=1, rope_theta=1000000.0)),
    # Qwen2 with use_sliding_window: layer 0 full, layer 1 a window of 5 over 16 tokens.
    "qwen2_sliding": ("qwen2", dict(window=5, max_window_layers=1)),
    # Qwen3: q/k RMSNorm and head_dim 32 with hidden 64 and 4 heads (hidden / heads would be 16).
    "qwen3_qknorm_head_dim": ("qwen3", dict(head_dim=32, rope_theta=1000000.0, rms_eps=1e-6)),
    # Mistral v0.1: a sliding window of 5, shorter than the 16-token sequence, in every layer.
    "mistral_window": ("mistral", dict(window=5, kv_heads=1)),
    # Qwen3-MoE: 4 layers, layer 1 dense (mlp_only_layers) and 0, 2, 3 sparse: 8 experts of width
    # 32, top-2 renormalised; head_dim 32 (hidden / heads = 16); the aux loss weighted 0.05.
    "qwen3_moe": ("qwen3_moe", dict(layers=4, head_dim=32, experts=8, top_k=2, moe_ffn=32,
                                    norm_topk=1, sparse_step=1, mlp_only="[1]", aux_coef=0.05,
                                    rope_theta=1000000.0, rms_eps=1e-6)),
    # Mixtral: 2 sparse layers of 8 experts (width --ffn 128), top-2; a sliding window of 6 over
    # the 16 tokens; aux loss weighted 0.02 (Mixtral's default).
    "mixtral": ("mixtral", dict(experts=8, top_k=2, window=6, aux_coef=0.02,
                                rope_theta=1000000.0)),
}


def build_model(family, o):
    import torch
    import transformers

    config_cls, model_cls, config_args = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(**config_args(o))
    # The plain attention: no fused kernel whose rounding could differ between machines.
    cfg._attn_implementation = "eager"
    if family in MOE_DISK_NAMES and hasattr(cfg, "_experts_implementation"):
        # transformers 5: the per-expert loop, not a grouped-GEMM kernel.
        cfg._experts_implementation = "eager"
    return getattr(transformers, model_cls)(cfg).to(torch.float32)


def sparse_blocks(model):
    """(layer index, router module) of every mixture-of-experts layer: the layer's MLP (or 4.x
    Mixtral's block_sparse_moe) that has a `gate` whose weight is the router's [E, hidden]."""
    found = []
    for i, layer in enumerate(model.model.layers):
        for attr in ("mlp", "block_sparse_moe"):
            block = getattr(layer, attr, None)
            gate = getattr(block, "gate", None) if block is not None else None
            if gate is not None and getattr(gate, "weight", None) is not None:
                found.append((i, gate))
                break
    return found


def to_disk_names(family, name, tensor, saved_names):
    """{name in model.safetensors: tensor} for a parameter (or its gradient) named `name` in
    named_parameters(): the same name, or the per-expert pieces of transformers 5's fused expert
    tensors (gate_up_proj [E, 2I, H] is gate rows then up rows; down_proj [E, H, I]), or Mixtral's
    router mlp.gate renamed to block_sparse_moe.gate."""
    import re

    if name in saved_names:
        return {name: tensor}
    if family not in MOE_DISK_NAMES:
        raise SystemExit(f"{name}: not in the saved model.safetensors")
    gate_name, up_name, down_name, router_name = MOE_DISK_NAMES[family]
    m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
    out = {}
    if m:
        prefix, kind = m.groups()
        for e in range(tensor.shape[0]):
            if kind == "gate_up_proj":
                half = tensor.shape[1] // 2
                out[f"{prefix}.{gate_name.format(e=e)}"] = tensor[e, :half]
                out[f"{prefix}.{up_name.format(e=e)}"] = tensor[e, half:]
            else:
                out[f"{prefix}.{down_name.format(e=e)}"] = tensor[e]
    else:
        m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.gate\.weight", name)
        if m:
            out[f"{m.group(1)}.{router_name}"] = tensor
    missing = [n for n in out if n not in saved_names]
    if not out or missing:
        raise SystemExit(f"{name}: save_pretrained wrote no tensor of that name nor the per-expert "
                         f"names {missing or '(no known layout)'}; update to_disk_names for this "
                         "transformers version")
    return {n: t.contiguous() for n, t in out.items()}


def reference_aux_loss(router_logits, num_experts, top_k):
    """transformers' load_balancing_loss_func without an attention mask, computed here from the raw
    router logits of every sparse layer (concatenated over layers, ONE softmax): num_experts times
    the sum over experts of (fraction of routed slots) x (mean router probability)."""
    import torch

    logits = torch.cat(router_logits, dim=0)
    probs = torch.softmax(logits, dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    mask = torch.nn.functional.one_hot(chosen, num_experts).float()  # [T, k, E]
    return (mask.mean(dim=0) * probs.mean(dim=0).unsqueeze(0)).sum() * num_experts, probs


def make_fixture(out_dir, family, o):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    # The order of the random draws fixes the fixture: the seed, then the model's initialisation,
    # then the batch. Nothing else may draw from torch's generator in between.
    torch.manual_seed(o["seed"])
    model = build_model(family, o)
    moe = family in MOE_DISK_NAMES
    # transformers initialises biases to zero, which would leave their addition untested by the
    # logits; fixtures with biases (qwen2) draw them instead. MoE fixtures draw their experts
    # (normal(0, initializer_range), whatever the version's own initialisation) and routers
    # (normal(0, router_std)).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.02)
            elif moe and ".experts." in name:
                p.normal_(0.0, model.config.initializer_range)
        if moe:
            for _, gate in sparse_blocks(model):
                gate.weight.normal_(0.0, o["router_std"])
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    ids = torch.randint(0, o["vocab"], (o["batch"], o["seq"]), dtype=torch.int64)
    save_file({"input_ids": ids}, os.path.join(out_dir, "batch.safetensors"))

    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        saved = {n: f.get_tensor(n) for n in f.keys()}
    # The name mapping must reproduce exactly what save_pretrained wrote.
    mapped = {}
    for name, p in model.named_parameters():
        mapped.update(to_disk_names(family, name, p.detach(), saved))
    for n, t in mapped.items():
        if not torch.equal(t, saved[n]):
            raise SystemExit(f"{n}: the split of the in-memory parameter differs from what "
                             "save_pretrained wrote; the fused layout is not what to_disk_names "
                             "assumes")
    unmapped = set(saved) - set(mapped) - {"lm_head.weight"}
    if unmapped:
        raise SystemExit(f"save_pretrained wrote tensors no parameter maps to: {sorted(unmapped)}")

    router_logits, hooks = [], []
    if moe:
        blocks = sparse_blocks(model)
        if not blocks:
            raise SystemExit("no mixture-of-experts layer found in the model")

        def capture(module, args, kwargs, output):
            # The router's input, however it is passed (positionally or by keyword).
            hidden = args[0] if args else next(iter(kwargs.values()))
            router_logits.append(torch.nn.functional.linear(
                hidden.reshape(-1, module.weight.shape[1]), module.weight).detach())

        hooks = [gate.register_forward_hook(capture, with_kwargs=True) for _, gate in blocks]
    out = model(input_ids=ids, labels=ids)
    for h in hooks:
        h.remove()
    expected = {"logits": out.logits.detach().contiguous(), "loss": out.loss.detach().reshape(())}
    if moe:
        aux = out.aux_loss.detach().reshape(())
        want_aux, probs = reference_aux_loss(router_logits, o["experts"], o["top_k"])
        if abs(aux.item() - want_aux.item()) > 1e-6 * max(1.0, abs(want_aux.item())):
            twice, _ = reference_aux_loss([torch.softmax(x, -1) for x in router_logits],
                                          o["experts"], o["top_k"])
            raise SystemExit(
                f"transformers' aux_loss {aux.item()} is not the load-balancing loss of the raw "
                f"router logits ({want_aux.item()}; with a second softmax: {twice.item()}). The "
                "C++ model computes it with one softmax (docs/models.md); check this version's "
                "router and load_balancing_loss_func")
        logits = out.logits.detach()
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                               ids[:, 1:].reshape(-1))
        if abs(out.loss.item() - (ce.item() + o["aux_coef"] * aux.item())) > 1e-5:
            raise SystemExit(f"loss {out.loss.item()} is not cross-entropy {ce.item()} + "
                             f"{o['aux_coef']} * aux_loss {aux.item()}")
        # Rounding must not be able to change a token's experts: the k-th and (k+1)-th router
        # probabilities of every token are kept apart.
        top = torch.topk(probs, o["top_k"] + 1, dim=-1).values
        gap = (top[:, -2] - top[:, -1]).min().item()
        print(f"  smallest gap between a token's expert {o['top_k']} and {o['top_k'] + 1}: {gap:.2e}")
        if gap < 1e-5:
            raise SystemExit("a token's router probabilities are nearly tied at the top-k boundary; "
                             "pick another --seed or --router-std")
        expected["aux_loss"] = aux
    out.loss.backward()
    for name, p in model.named_parameters():
        for n, g in to_disk_names(family, name, p.grad.detach(), saved).items():
            expected["grad." + n] = g.contiguous()
    save_file(expected, os.path.join(out_dir, "expected.safetensors"))

    # AdamW from the same initial weights on the same batch; the loss is taken before each step.
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], **ADAMW)
    losses = []
    for _ in range(o["steps"]):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    train = {
        "optimizer": {"name": "adamw", "lr": o["lr"], "betas": list(ADAMW["betas"]),
                      "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"],
                      "weight_decay_on": "all parameters", "grad_clip": None},
        "losses_before_each_step": losses,
        "torch": torch.__version__,
    }
    if moe:
        import transformers

        train["transformers"] = transformers.__version__
    with open(os.path.join(out_dir, "train.json"), "w") as f:
        json.dump(train, f, indent=1)
    if o["rope"] and json.loads(o["rope"]).get("rope_type") == "dynamic":
        write_rope_sequence(out_dir, family, ids)
    return expected["loss"].item(), losses


# Forward lengths (prefixes of the batch) for a dynamic-RoPE fixture's rope_sequence.safetensors,
# chosen around its max_position_embeddings of 8: growth (12, 16, 13), a shorter one after a longer
# one that keeps the longer one's frequencies (10, 9, and 8, which is not below 8), a reset (6)
# and growth from the reset state (11).
ROPE_SEQUENCE = [12, 10, 16, 9, 8, 6, 11, 13]


def write_rope_sequence(out_dir, family, ids):
    """rope_sequence.safetensors: one fresh instance of the saved model (from_pretrained, so its
    rotary embedding starts from the original frequencies) runs a no-grad forward of
    input_ids[:, :L] for each L of ROPE_SEQUENCE in turn; after each, the logits and the rotary
    embedding's inv_freq and max_seq_len_cached (transformers' dynamic_rope_update state; -1 when
    the installed version keeps it under another name). Tensors: lengths i64 [n],
    max_seq_len_cached i64 [n], logits.<k> f32 [batch, L, vocab], inv_freq.<k> f32 [head_dim / 2].
    Only the order of the forwards matters: nothing here draws random numbers."""
    import torch
    import transformers
    from safetensors.torch import save_file

    model = getattr(transformers, FAMILIES[family][1]).from_pretrained(
        out_dir, attn_implementation="eager").to(torch.float32)
    model.eval()
    rotary = model.model.rotary_emb
    out = {"lengths": torch.tensor(ROPE_SEQUENCE, dtype=torch.int64)}
    cached = []
    with torch.no_grad():
        for k, n in enumerate(ROPE_SEQUENCE):
            if n > ids.shape[1]:
                raise SystemExit(f"rope sequence length {n} is longer than the batch")
            out[f"logits.{k}"] = model(input_ids=ids[:, :n]).logits.contiguous()
            out[f"inv_freq.{k}"] = rotary.inv_freq.detach().to(torch.float32).clone()  # its own storage
            c = getattr(rotary, "max_seq_len_cached", None)
            cached.append(int(c) if c is not None else -1)
    out["max_seq_len_cached"] = torch.tensor(cached, dtype=torch.int64)
    print(f"  rope sequence {ROPE_SEQUENCE}: max_seq_len_cached after each {cached}")
    save_file(out, os.path.join(out_dir, "rope_sequence.safetensors"))


def compare_fixture(new_dir, old_dir):
    """Prints how new_dir differs from old_dir; returns False when they do not agree."""
    import torch
    from safetensors import safe_open

    ok = True
    for fname in ("batch.safetensors", "model.safetensors", "expected.safetensors"):
        with safe_open(os.path.join(new_dir, fname), "pt") as a, \
                safe_open(os.path.join(old_dir, fname), "pt") as b:
            names_a, names_b = set(a.keys()), set(b.keys())
            if names_a != names_b:
                print(f"  {fname}: only new: {sorted(names_a - names_b)}, "
                      f"only old: {sorted(names_b - names_a)}")
                ok = False
            worst, worst_name = 0.0, ""
            for n in sorted(names_a & names_b):
                ta, tb = a.get_tensor(n), b.get_tensor(n)
                if ta.dtype != tb.dtype or ta.shape != tb.shape:
                    print(f"  {fname}: {n}: new {ta.dtype} {list(ta.shape)}, "
                          f"old {tb.dtype} {list(tb.shape)}")
                    ok = False
                    continue
                if fname != "expected.safetensors":
                    # Same seed and torch: the draws must be identical.
                    if not torch.equal(ta, tb):
                        print(f"  {fname}: {n} differs (another seed or torch version?)")
                        ok = False
                    continue
                scale = tb.abs().max().item() or 1.0
                rel = (ta.double() - tb.double()).abs().max().item() / scale
                if rel > worst:
                    worst, worst_name = rel, n
            if fname == "expected.safetensors":
                print(f"  {fname}: largest difference {worst:.2e} of max |old| ({worst_name or '-'})")
                # The C++ test allows 1e-4; a regenerated fixture should sit far below that.
                if worst > 1e-5:
                    ok = False
    with open(os.path.join(new_dir, "train.json")) as f:
        new_train = json.load(f)
    with open(os.path.join(old_dir, "train.json")) as f:
        old_train = json.load(f)
    if new_train["optimizer"] != old_train["optimizer"]:
        print(f"  train.json: optimizer {new_train['optimizer']} vs {old_train['optimizer']}")
        ok = False
    la, lb = new_train["losses_before_each_step"], old_train["losses_before_each_step"]
    if len(la) != len(lb):
        print(f"  train.json: {len(la)} losses vs {len(lb)}")
        ok = False
    else:
        d = max((abs(x - y) for x, y in zip(la, lb)), default=0.0)
        print(f"  train.json: losses differ by at most {d:.2e}")
        if d > 1e-5:
            ok = False
    with open(os.path.join(new_dir, "config.json")) as f:
        new_cfg = json.load(f)
    with open(os.path.join(old_dir, "config.json")) as f:
        old_cfg = json.load(f)
    for k in sorted(set(new_cfg) | set(old_cfg)):
        if k != "transformers_version" and new_cfg.get(k) != old_cfg.get(k):
            print(f"  config.json: {k}: new {new_cfg.get(k)!r}, old {old_cfg.get(k)!r}")
            ok = False
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="fixtures to write (presets, or a new name with "
                    "--family)")
    ap.add_argument("--all", action="store_true", help="write every preset")
    ap.add_argument("--list", action="store_true", help="print the presets and exit")
    ap.add_argument("--out-root", default=os.path.join(REPO, "tests", "data", "hf"),
                    help="folder that receives NAME/ (default: tests/data/hf)")
    ap.add_argument("--compare", metavar="DIR", help="compare each fixture with DIR/NAME")
    ap.add_argument("--family", help="model family of a fixture that is not a preset "
                    f"({', '.join(sorted(FAMILIES))})")
    for key, value in DEFAULTS.items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(value), default=None,
                        help=f"(default {value}, or the preset's)")
    a = ap.parse_args()

    if a.list:
        for name, (family, over) in FIXTURES.items():
            print(f"{name}: {family} {json.dumps(over)}")
        return 0
    names = list(FIXTURES) if a.all else a.names
    if not names:
        ap.error("name a fixture, or pass --all (--list shows the presets)")
    overrides = {k: getattr(a, k) for k in DEFAULTS if getattr(a, k) is not None}
    if overrides and any(n in FIXTURES for n in names):
        # A preset is what tests/data/hf/NAME holds; changed options would write something else
        # under its name.
        ap.error(f"{', '.join('--' + k.replace('_', '-') for k in overrides)} cannot change a "
                 "preset; give the fixture a new name and --family")

    if a.compare and os.path.realpath(a.compare) == os.path.realpath(a.out_root):
        ap.error("--compare names the folder being written; write elsewhere with --out-root")
    all_ok = True
    for name in names:
        if name in FIXTURES:
            family, preset = FIXTURES[name]
            if a.family and a.family != family:
                ap.error(f"preset '{name}' is a {family} fixture, not {a.family}")
        elif a.family:
            if a.family not in FAMILIES:
                ap.error(f"unknown --family '{a.family}'; known: {', '.join(sorted(FAMILIES))}")
            family, preset = a.family, {}
        else:
            ap.error(f"'{name}' is not a preset ({', '.join(FIXTURES)}); give --family to make "
                     "a new fixture")
        o = dict(DEFAULTS, **preset, **overrides)
        out_dir = os.path.join(a.out_root, name)
        loss, losses = make_fixture(out_dir, family, o)
        print(json.dumps({"fixture": name, "out": out_dir, "loss": loss, "losses": losses}))
        if a.compare:
            old = os.path.join(a.compare, name)
            if not os.path.isdir(old):
                print(f"  nothing to compare with: {old} does not exist")
                all_ok = False
            elif not compare_fixture(out_dir, old):
                print(f"  {name}: DIFFERS from {old}")
                all_ok = False
            else:
                print(f"  {name}: matches {old}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
