"""The benchmark shapes shared by the PyTorch reference scripts (torch_reference.py,
torch_fsdp2.py) and configs/llama-*.yaml, and the model they build: a Hugging Face
LlamaForCausalLM with untied embeddings. Imported by the scripts beside it; needs transformers
only when a model is built.
"""
from collections import namedtuple

Shape = namedtuple("Shape", "hidden layers heads kv_heads ffn vocab seq micro_batch rope_theta")

SHAPES = {
    "llama-125m": Shape(768, 12, 12, 12, 2048, 32000, 1024, 16, 10000.0),
    "llama-1b": Shape(2048, 16, 32, 8, 8192, 128256, 2048, 4, 10000.0),
    "llama-8b": Shape(4096, 32, 32, 8, 14336, 128256, 8192, 1, 500000.0),
}


def shape_named(name):
    if name not in SHAPES:
        raise SystemExit(f"unknown size '{name}'; known: {', '.join(SHAPES)}")
    return SHAPES[name]


def hf_llama_config(shape, attn_implementation="sdpa"):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      intermediate_size=shape.ffn, vocab_size=shape.vocab,
                      max_position_embeddings=shape.seq, rope_theta=shape.rope_theta,
                      tie_word_embeddings=False)
    cfg._attn_implementation = attn_implementation
    return cfg


def flops_per_token(num_params, shape):
    """Model FLOPs per trained token, as accel-train's LlamaConfig::flops_per_token counts them:
    6 per weight of every matmul (all parameters but the input embedding, whose lookup is a
    gather; norms are counted too, a negligible excess), plus 12 * layers * seq * hidden for the
    attention scores and their use (forward and backward, the causal half counted in full)."""
    return 6 * (num_params - shape.vocab * shape.hidden) + 12 * shape.layers * shape.seq * shape.hidden
