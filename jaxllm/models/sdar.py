"""SDAR (JetAstra): the Qwen3 architecture trained for block diffusion.

GQA with per-head QK RMSNorm and full RoPE, SwiGLU MLPs, tied or untied embeddings. At inference attention is
block-causal (a token sees its own block and every earlier one) and logits predict in place.
"""

from flax import nnx

from jaxllm.config import ConfigError, ModelConfig, transformer_config
from jaxllm.loader import ConcatTransposed, Tensor, transpose, unchanged
from jaxllm.models.layers import MLP, DecoderLM

MODEL_TYPE = "sdar"


def config_from_hf(hf: dict) -> ModelConfig:
    if hf.get("attention_bias"):  # else the load fails on 'unused' bias tensors
        raise ConfigError("attention_bias=true (biased q/k/v/o projections) is not supported")
    # head_dim 128 when absent, as SDAR's config class (Qwen3's) defaults it, not hidden_size / heads
    return transformer_config(hf, MODEL_TYPE, partial_rotary_factor=1.0, block_size=4, default_head_dim=128)


class SDAR(DecoderLM):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, lambda _: MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs),
                         dtype=dtype, rngs=rngs)


def hf_weight_map(cfg: ModelConfig) -> dict[str, Tensor]:
    """Model parameter path -> the checkpoint tensors it is made of."""
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = {
        "input_layernorm/weight": (("input_layernorm.weight",), unchanged),
        "post_attention_layernorm/weight": (("post_attention_layernorm.weight",), unchanged),
        "attn/qkv_proj/kernel": (tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
                                 ConcatTransposed((q_width, kv_width, kv_width))),
        "attn/o_proj/kernel": (("self_attn.o_proj.weight",), transpose),
        "attn/q_norm/weight": (("self_attn.q_norm.weight",), unchanged),
        "attn/k_norm/weight": (("self_attn.k_norm.weight",), unchanged),
        "mlp/gate_up_proj/kernel": (("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                                    ConcatTransposed((cfg.intermediate_size,) * 2)),
        "mlp/down_proj/kernel": (("mlp.down_proj.weight",), transpose),
    }
    weights = {f"layers/{i}/{path}": Tensor(tuple(f"model.layers.{i}.{key}" for key in keys), convert)
               for i in range(cfg.num_layers) for path, (keys, convert) in per_layer.items()}
    weights["embed/embedding"] = Tensor(("model.embed_tokens.weight",), unchanged)
    weights["norm/weight"] = Tensor(("model.norm.weight",), unchanged)
    if not cfg.tie_word_embeddings:
        weights["lm_head/kernel"] = Tensor(("lm_head.weight",), transpose)
    return weights


# Checkpoint tensors that may be present but carry nothing this model reads.
IGNORED_KEYS = ("lm_head.weight",)
