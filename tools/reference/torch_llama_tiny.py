# configs/llama-tiny.yaml in PyTorch + transformers on a GPU: the same model shape, AdamW (betas
# 0.9/0.95, eps 1e-8, weight decay 0.1 on every parameter), linear warmup then cosine to 0.1x, grad
# clip 1.0, bf16 autocast over fp32 weights, 300 steps of 16 x 128 byte tokens of the fortunes
# texts, evaluation on 8 held-out batches. Its own initialization and data order, so runs compare
# with accel-train's in distribution (over seeds), not step by step. One JSON line per seed: the
# final eval loss and the largest gradient norm after step 15 (a spike shows as > 3).
#
#   python3 tools/reference/torch_llama_tiny.py --warmup 20 --seeds 1234 1 2 [--fortunes DIR]
import argparse, json, math, os, torch
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--warmup", type=int, default=50)
p.add_argument("--steps", type=int, default=300)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--seeds", type=int, nargs="+", default=[1234])
p.add_argument("--fortunes", default="/usr/share/games/fortunes")
a = p.parse_args()

files = ["fortunes", "literature", "wisdom", "humorists", "people", "science", "computers", "work",
         "education", "politics", "law", "love"]  # configs/llama-tiny.yaml's data.text_files
data = b"".join(open(os.path.join(a.fortunes, f), "rb").read() for f in files)
T, MB = 129, 16
n = len(data) // T
tok = torch.frombuffer(bytearray(data[: n * T]), dtype=torch.uint8).long().view(n, T)
n_eval = int(n * 0.05)
train, evals = tok[: n - n_eval].cuda(), tok[n - n_eval:].cuda()


def lr_at(step):
    if step <= a.warmup:
        return a.lr * step / a.warmup
    t = (step - a.warmup) / (a.steps - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def loss_of(model, b):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(b[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), b[:, 1:].reshape(-1))


for seed in a.seeds:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=384, vocab_size=256,
                      max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, initializer_range=0.02)
    model = LlamaForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    g = torch.Generator(device="cuda").manual_seed(seed)
    order = torch.randperm(train.shape[0], generator=g, device="cuda")
    gmax = 0.0
    for step in range(1, a.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = loss_of(model, train[order[(step - 1) * MB: step * MB]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        if step > 15:
            gmax = max(gmax, gn)
        opt.step()
    with torch.no_grad():
        ev = sum(loss_of(model, evals[i * MB:(i + 1) * MB]).item() for i in range(8)) / 8
    print(json.dumps({"warmup": a.warmup, "seed": seed, "eval_loss": ev, "grad_norm_max": gmax}),
          flush=True)
