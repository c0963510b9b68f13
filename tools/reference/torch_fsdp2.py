"""PyTorch FSDP2 reference for multi-GPU comparisons with accel-bench (issue #12).

A Hugging Face LlamaForCausalLM sharded with FSDP2 (`fully_shard` on every decoder layer, then on
the model), bf16 parameters with fp32 gradient reduction (MixedPrecisionPolicy), fused AdamW,
random tokens, the shapes of torch_reference.py and configs/llama-*.yaml (llama_shapes.py).
Each rank trains on its own micro-batch, so the global batch is world x micro-batch, as
accel-bench's rows at --num-processes N.

    torchrun --nproc_per_node 2 tools/reference/torch_fsdp2.py llama-1b 15 [--reshard|--no-reshard]

Rank 0 prints one JSON line: tokens/s over all ranks, per GPU, step time, peak memory per rank.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from llama_shapes import flops_per_token, hf_llama_config, shape_named


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    size = args[0]
    steps = int(args[1]) if len(args) > 1 else 15
    reshard = "--no-reshard" not in sys.argv
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    shape = shape_named(size)
    vocab, seq, micro = shape.vocab, shape.seq, shape.micro_batch
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_llama_config(shape))
    nparams = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    data = torch.randint(0, vocab, (steps + 5, micro, seq), device="cuda", generator=gen)
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for i in range(steps + 5):
        if i == 5:
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.time()
        out = model(input_ids=data[i], labels=data[i])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    torch.cuda.synchronize()
    dist.barrier()
    dt = (time.time() - t0) / steps
    tokens = world * micro * seq / dt
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        flops_tok = flops_per_token(nparams, shape)
        print(json.dumps({"size": size, "variant": "fsdp2-bf16", "world": world,
                          "reshard_after_forward": reshard, "params": nparams,
                          "tokens_per_s": round(tokens), "tokens_per_s_per_gpu": round(tokens / world),
                          "step_ms": round(dt * 1e3, 1),
                          "mfu_vs_989": round(flops_tok * tokens / world / 989e12, 3),
                          "peak_mem_gib_max_rank": round(peak.item(), 2),
                          "loss_first": round(losses[0], 3), "loss_last": round(losses[-1], 3)}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
