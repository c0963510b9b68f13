"""The benchmark shapes shared by the PyTorch reference scripts (torch_reference.py,
torch_fsdp2.py) and configs/llama-*.yaml, and the model they build: a Hugging Face
LlamaForCausalLM with untied embeddings. FAMILY_SIZES holds the real shapes of the other
families' checkpoints (configs/llama-3.2-1b.yaml, qwen3-*.yaml, qwen2.5-1.5b.yaml,
mistral-7b.yaml) and of configs/moe-small.yaml as config.json fields. Imported by the scripts
beside it; needs transformers only when a model is built.
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


# Hugging Face config.json fields of real checkpoints (random init here), with the benchmark's
# seq and micro-batch: the same shapes as configs/<name>.yaml.
FAMILY_SIZES = {
    "llama-3.2-1b": (dict(model_type="llama", hidden_size=2048, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                          intermediate_size=8192, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500000.0,
                          rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=8192),
                          rms_norm_eps=1e-5, tie_word_embeddings=True), 2048, 4),
    "qwen3-0.6b": (dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
                        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
                   2048, 4),
    "qwen3-1.7b": (dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
                        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
                   2048, 4),
    "qwen2.5-1.5b": (dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28,
                          num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                          vocab_size=151936, max_position_embeddings=131072,
                          rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                          use_sliding_window=False, max_window_layers=28), 2048, 4),
    "mistral-7b": (dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                        vocab_size=32000, max_position_embeddings=32768, rope_theta=10000.0,
                        rms_norm_eps=1e-5, sliding_window=4096, tie_word_embeddings=False),
                   4096, 1),
    # configs/moe-small.yaml: Qwen3-MoE with 16 experts of width 1024 in every layer, top-2.
    "moe-small": (dict(model_type="qwen3_moe", hidden_size=1536, num_hidden_layers=16,
                       num_attention_heads=12, num_key_value_heads=4, head_dim=128,
                       intermediate_size=4096, moe_intermediate_size=1024, num_experts=16,
                       num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[], router_aux_loss_coef=0.01, output_router_logits=True,
                       vocab_size=151936, max_position_embeddings=4096, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
                  2048, 4),
}


def hf_family_config(fields, attn_implementation="sdpa"):
    """A transformers config of fields["model_type"] from config.json-style fields (rope_theta +
    rope_scaling; transformers 5 takes them as rope_parameters)."""
    import transformers

    fields = dict(fields)
    model_type = fields.pop("model_type")
    if int(transformers.__version__.split(".")[0]) >= 5:
        params = dict(fields.pop("rope_scaling", None) or {"rope_type": "default"})
        params["rope_theta"] = fields.pop("rope_theta")
        fields["rope_parameters"] = params
    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    cfg._attn_implementation = attn_implementation
    return cfg


def family_shape(fields, seq, micro_batch):
    """The Shape of config.json-style fields (for flops_per_token and the batch)."""
    return Shape(fields["hidden_size"], fields["num_hidden_layers"],
                 fields["num_attention_heads"], fields.get("num_key_value_heads"),
                 fields["intermediate_size"], fields["vocab_size"], seq, micro_batch,
                 fields.get("rope_theta", 10000.0))


def flops_per_token_tied(num_params, shape, tied):
    """flops_per_token for a model whose lm_head may share the embedding: a tied head is still a
    matmul (counted once more), as accel-train's DecoderConfig::flops_per_token counts it."""
    return flops_per_token(num_params + (shape.vocab * shape.hidden if tied else 0), shape)
