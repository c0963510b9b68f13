# PyTorch's fused attention backends (flash, cuDNN, efficient) at the llama-1b and llama-125m
# attention shapes, causal bf16: forward and backward ms and TFLOP/s (causal FLOPs: fwd 4BHS^2D/2,
# bwd 2.5x), to set beside bench_cuda_kernels' "attention" rows.
import torch, json
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F
def bench(f, iters=20):
    for _ in range(3): f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(iters): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters
for name, (B, S, Hq, Hkv, D) in {"llama-1b": (4, 2048, 32, 8, 64), "llama-125m": (16, 1024, 12, 12, 64)}.items():
    fl = 4.0 * B * Hq * S * S * D / 2
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        def run(gqa):
            with sdpa_kernel([be]):
                kk, vv = (k, v) if gqa or Hq == Hkv else (k.repeat_interleave(Hq // Hkv, 1).detach().requires_grad_(), v.repeat_interleave(Hq // Hkv, 1).detach().requires_grad_())
                f = lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa and Hq != Hkv)
                g = torch.randn_like(f())
                fwd = bench(f)
                tot = bench(lambda: torch.autograd.grad(f(), (q, kk, vv), g))
                return fwd, tot - fwd
        label = str(be).split('.')[-1]
        try:
            try:
                fwd, bwd = run(True)
            except Exception:
                fwd, bwd = run(False); label += " (k/v expanded)"
            print(f"{name:10s} {label:34s} fwd {fwd:6.3f} ms {fl/fwd/1e9:6.1f} TFLOP/s | bwd {bwd:6.3f} ms {2.5*fl/bwd/1e9:6.1f} TFLOP/s")
        except Exception as ex:
            print(f"{name:10s} {label:34s} unavailable: {str(ex).splitlines()[0][:100]}")
