#!/usr/bin/env python3
"""The PyTorch reference for accel-train's single-GPU numbers: a Hugging Face LlamaForCausalLM
trained through Accelerate, the way a PyTorch user would set it up, on random tokens. Run it in
the same GPU call as accel-train/accel-bench at the same shape and compare the ratio of tokens/s
and of peak memory (absolute numbers drift between machines and runs). Needs torch, transformers
and accelerate (docs/performance.md has the measurements, tools/reference/README.md how to run).

    python3 tools/reference/torch_reference.py SIZE VARIANT [STEPS]

SIZE: llama-125m, llama-1b, llama-8b (llama_shapes.py; configs/llama-*.yaml are the same shapes),
  or a family size of llama_shapes.FAMILY_SIZES: llama-3.2-1b, qwen3-0.6b, qwen3-1.7b,
  qwen2.5-1.5b, mistral-7b, moe-small (the Hugging Face class of its model_type:
  Qwen3ForCausalLM, Qwen3MoeForCausalLM, ...; configs/<size>.yaml), or --config-json FILE: a config.json (its model_type's class) with
  --seq and --micro-batch (default 2048 and 4).
VARIANT:
  bf16           Accelerate mixed_precision "bf16" (autocast over fp32 weights), eager
  bf16-compile   the same under torch.compile
  fp8-compile    every Linear but lm_head in fp8 with per-tensor dynamic scaling (torchao's
                 tensorwise recipe: e4m3 inputs and weights, e5m2 output gradients), the GEMMs
                 through torch._scaled_mm, under torch.compile
  any of them with "-ckpt" appended: transformers' gradient checkpointing per decoder layer
  (llama-8b needs it to fit on one GPU)
STEPS: timed steps (default 20), after 5 untimed warm-up steps (which include compilation).

Always fused AdamW (lr 1e-4), SDPA attention, seed 0. Prints one JSON line: size, variant,
params, tokens_per_s, step_ms, model_tflops, mfu_vs_989 (of an H100/H200's 989 dense bf16
TFLOP/s), peak_mem_gib (torch.cuda.max_memory_allocated over the steps), warmup_s (the five
warm-up steps), loss_first, loss_last. FLOPs per token as llama_shapes.flops_per_token, over the active parameters of a mixture of
experts (qwen3_moe / mixtral config.json: the experts count top_k / num_experts).
"""
import json
import sys
import time

import torch
import torch.nn as nn

from llama_shapes import (FAMILY_SIZES, family_shape, flops_per_token_tied, hf_family_config,
                          hf_llama_config, shape_named)

WARMUP_STEPS = 5
PEAK_TFLOPS = 989.0
VARIANTS = ("bf16", "bf16-compile", "fp8-compile")


def parse_variant(variant):
    """-> (fp8, compile, checkpointing)"""
    ckpt = variant.endswith("-ckpt")
    base = variant[: -len("-ckpt")] if ckpt else variant
    if base not in VARIANTS:
        raise SystemExit(f"unknown variant '{variant}'; known: {', '.join(VARIANTS)}, each "
                         "optionally with -ckpt")
    return base.startswith("fp8"), base.endswith("-compile"), ckpt


# ---- fp8 linear layers (per-tensor dynamic scaling) -----------------------------------------

def quantize(t, dtype):
    """t (2-d) as fp8 with one scale from its own max |t|: returns (codes, 1 / scale), the
    dequantization factor _scaled_mm takes. Values beyond the format's range saturate."""
    limit = torch.finfo(dtype).max
    scale = limit / t.abs().amax().float().clamp(min=1e-12)
    codes = (t.float() * scale).clamp(-limit, limit).to(dtype)
    return codes, scale.reciprocal()


def column_major(t):
    # _scaled_mm wants its second operand column-major: the same [rows, cols] view over a
    # transposed copy.
    return t.t().contiguous().t()


class Fp8Matmul(torch.autograd.Function):
    """y = x . w^T with x, w in e4m3; backward with the output gradient in e5m2. Saves the fp8
    codes of x and w (one byte per element) for backward."""

    @staticmethod
    def forward(ctx, x, weight):
        x_shape = x.shape
        x2 = x.reshape(-1, x_shape[-1])
        xq, x_inv = quantize(x2, torch.float8_e4m3fn)
        wq, w_inv = quantize(weight, torch.float8_e4m3fn)
        # [M, K] row-major times the [K, N] column-major view of w [N, K].
        y = torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=torch.bfloat16)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.x_shape, ctx.w_dtype = x_shape, weight.dtype
        return y.reshape(*x_shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        gq, g_inv = quantize(g2, torch.float8_e5m2)
        # dX [M, K] = dY [M, N] . W [N, K]
        grad_x = torch._scaled_mm(gq, column_major(wq), scale_a=g_inv, scale_b=w_inv,
                                  out_dtype=torch.bfloat16)
        # dW [N, K] = dY^T [N, M] . X [M, K], in the weight's dtype (fp32 masters here)
        grad_w = torch._scaled_mm(gq.t().contiguous(), column_major(xq), scale_a=g_inv,
                                  scale_b=x_inv, out_dtype=ctx.w_dtype)
        return grad_x.reshape(ctx.x_shape), grad_w


class Fp8Linear(nn.Linear):
    def forward(self, x):
        # The input in the dtype autocast would give a bf16 Linear; the weight from its fp32.
        y = Fp8Matmul.apply(x.to(torch.bfloat16), self.weight)
        # A bias (Qwen2's q/k/v) is added in bf16, outside the fp8 GEMM.
        return y if self.bias is None else y + self.bias.to(y.dtype)


def convert_to_fp8(model):
    """Runs every nn.Linear but the LM head in fp8 (the vocabulary-sized output layer stays in
    bf16); the parameters stay the same objects."""
    converted = 0
    for name, module in model.named_modules():
        if type(module) is nn.Linear and not name.endswith("lm_head"):
            module.__class__ = Fp8Linear
            converted += 1
    return converted


# ---- the benchmark ------------------------------------------------------------------------------

def active_parameters(model, fields, num_params):
    """The parameters one token uses: all of them for a dense model; for a mixture of experts
    (qwen3_moe, mixtral) the experts' parameters count num_experts_per_tok / num_experts."""
    experts = fields.get("num_experts") or fields.get("num_local_experts")
    if not experts:
        return num_params
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    if expert_params == 0:
        raise SystemExit(f"{type(model).__name__} has {experts} experts but no parameter named "
                         "'.experts.': the active-parameter count would be wrong")
    top_k = fields["num_experts_per_tok"]
    return num_params - expert_params + expert_params * top_k // experts


def parse_args(argv):
    """-> (size name, variant, steps, config-json fields or None, seq, micro_batch)"""
    args = list(argv)
    fields, seq, micro_batch = None, 2048, 4
    for flag in ("--config-json", "--seq", "--micro-batch"):
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                raise SystemExit(f"{flag} needs a value")
            value = args[i + 1]
            del args[i:i + 2]
            if flag == "--config-json":
                with open(value) as f:
                    fields = json.load(f)
            elif flag == "--seq":
                seq = int(value)
            else:
                micro_batch = int(value)
    if fields is not None:
        if len(args) not in (1, 2):
            raise SystemExit(__doc__)
        path = argv[argv.index("--config-json") + 1]
        steps = int(args[1]) if len(args) == 2 else 20
        return path, args[0], steps, fields, seq, micro_batch
    if len(args) not in (2, 3):
        raise SystemExit(__doc__)
    return args[0], args[1], int(args[2]) if len(args) == 3 else 20, None, seq, micro_batch


def main():
    size, variant, steps, fields, seq, micro_batch = parse_args(sys.argv[1:])
    if steps < 1:
        raise SystemExit(f"STEPS must be at least 1, got {steps}")
    if fields is None and size in FAMILY_SIZES:
        fields, seq, micro_batch = FAMILY_SIZES[size]
    fp8, compile_model, ckpt = parse_variant(variant)
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="bf16")
    # fp32 weights, initialised on the GPU itself: on the CPU, llama-8b's initialisation alone
    # takes minutes of a device call.
    with torch.device(accelerator.device):
        if fields is None:
            shape = shape_named(size)
            tied = False
            model = LlamaForCausalLM(hf_llama_config(shape))
        else:
            shape = family_shape(fields, seq, micro_batch)
            tied = bool(fields.get("tie_word_embeddings", False))
            model = AutoModelForCausalLM.from_config(hf_family_config(fields))
    num_params = sum(p.numel() for p in model.parameters())
    # Mixture of experts: MFU counts the parameters a token passes through (top_k of the
    # experts), as accel-train's DecoderConfig::flops_per_token does.
    flop_params = active_parameters(model, fields or {}, num_params)
    model_class = type(model).__name__
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = model.to(accelerator.device)
    if fp8:
        convert_to_fp8(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    if compile_model:
        model = torch.compile(model)

    batches = torch.randint(0, shape.vocab, (WARMUP_STEPS + steps, shape.micro_batch, shape.seq),
                            device=accelerator.device)
    losses = []
    torch.cuda.reset_peak_memory_stats()
    t_start = time.time()
    for i in range(WARMUP_STEPS + steps):
        if i == WARMUP_STEPS:
            torch.cuda.synchronize()
            t_timed = time.time()
        out = model(input_ids=batches[i], labels=batches[i])
        accelerator.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())  # also waits for the step
        if i == WARMUP_STEPS - 1:
            warmup_s = time.time() - t_start
    torch.cuda.synchronize()
    step_s = (time.time() - t_timed) / steps
    tokens_per_s = shape.micro_batch * shape.seq / step_s
    flops = flops_per_token_tied(flop_params, shape, tied) * tokens_per_s
    print(json.dumps({
        "size": size, "model": model_class, "variant": variant, "params": num_params,
        "active_params": flop_params,
        "tokens_per_s": round(tokens_per_s), "step_ms": round(step_s * 1e3, 1),
        "model_tflops": round(flops / 1e12, 1),
        "mfu_vs_989": round(flops / (PEAK_TFLOPS * 1e12), 3),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "warmup_s": round(warmup_s, 1),
        "loss_first": round(losses[0], 3), "loss_last": round(losses[-1], 3),
    }), flush=True)


if __name__ == "__main__":
    main()
