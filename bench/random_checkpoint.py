"""The benchmarks' random-weight checkpoints: transformers' own initialisation after
torch.manual_seed(seed), built on a device, saved with save_pretrained (speed does not depend on
the weights' values; the same seed, versions and device give the same bytes).

One maker for bench/make_hybrid_model.py and the scripts of bench/gpu (prepare.py,
prepare_hybrid.py, long_context.py, hybrid_check.py, fidelity.py, and through them selfcheck.py
and oom_check.py), which put bench/ on sys.path to import it. Also the shapes they share: the
widths of Qwen3.5/3.6-27B and Qwen3.5/3.6-35B-A3B and their 3 : 1 pattern of Gated DeltaNet and
gated-attention layers.
"""

import contextlib

import torch

# Qwen3.5/3.6-27B: hidden 5120, gated attention 24 q / 4 kv heads of 256, Gated DeltaNet 16 key /
# 48 value heads of 128, intermediate 17408
QWEN3_5_27B_WIDTH = dict(
    hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
# Qwen3.5/3.6-35B-A3B: hidden 2048, attention 16 / 2 heads of 256, GDN 16 / 32 heads of 128,
# 256 experts top 8 of intermediate 512 and a shared expert of 512
QWEN3_5_35B_A3B_WIDTH = dict(
    hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
)


def hybrid_layer_types(n):
    """Full attention every 4th layer, as in the real models: [lin, lin, lin, full, lin, ...]."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def hybrid_configs(dense_layers, moe_layers, vocab=32000):
    """bench/gpu's hybrid models: the 27B width with dense_layers layers ("27b",
    Qwen3_5ForCausalLM) and the 35B-A3B width with moe_layers layers ("moe",
    Qwen3_5MoeForCausalLM), both in the 3 : 1 pattern; vocabulary 32,000 instead of 248,320 (only
    the embedding table, which is not matmul work), untied lm_head."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    def common(n):
        return dict(num_hidden_layers=n, vocab_size=vocab, max_position_embeddings=8192,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                    layer_types=hybrid_layer_types(n), tie_word_embeddings=False)

    dense = Qwen3_5TextConfig(**QWEN3_5_27B_WIDTH, **common(dense_layers))
    moe = Qwen3_5MoeTextConfig(**QWEN3_5_35B_A3B_WIDTH, **common(moe_layers))
    return {"27b": (dense, "Qwen3_5ForCausalLM"), "moe": (moe, "Qwen3_5MoeForCausalLM")}


def model_class(cls):
    """A transformers model class, given as itself or by its name."""
    if isinstance(cls, str):
        import transformers

        return getattr(transformers, cls)
    return cls


def random_model(cfg, cls=None, *, device=None, dtype=torch.float32, from_config=False, init_dtype=None, seed=0,
                 **kwargs):
    """The model of `cfg` with transformers' own initialisation after torch.manual_seed(seed), built
    under torch.device(device) when a device is given.

    from_config=True: built in `dtype` by cls._from_config(cfg, dtype=dtype, **kwargs)
    (AutoModelForCausalLM.from_config when cls is None), as from_pretrained(dtype=...) builds it:
    the weights are drawn in `dtype`, buffers transformers computes in float32 (the rotary inverse
    frequencies) stay float32. Otherwise cls(cfg), drawn in torch's default dtype (float32, or
    `init_dtype` while it is built), then cast with .to(dtype), buffers included."""
    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        if from_config:
            if cls is None:
                from transformers import AutoModelForCausalLM

                return AutoModelForCausalLM.from_config(cfg, dtype=dtype, **kwargs)
            return model_class(cls)._from_config(cfg, dtype=dtype, **kwargs)
        if init_dtype is None:
            return model_class(cls)(cfg, **kwargs).to(dtype)
        torch.set_default_dtype(init_dtype)
        try:
            return model_class(cls)(cfg, **kwargs).to(dtype)
        finally:
            torch.set_default_dtype(torch.float32)


def save(model, path, max_shard_size=None):
    """save_pretrained (safetensors), in shards of max_shard_size when given."""
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)


def base_parameters(model):
    """Parameters of the decoder stack (model.model): no lm_head."""
    return sum(p.numel() for p in model.model.parameters())
