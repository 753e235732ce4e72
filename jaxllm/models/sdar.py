"""SDAR (JetAstra): the Qwen3 architecture trained for block diffusion.

GQA with per-head QK RMSNorm and full RoPE, SwiGLU MLPs, tied or untied embeddings. At inference attention is
block-causal (a token sees its own block and every earlier one) and logits predict in place.
"""

from flax import nnx

from jaxllm.config import ModelConfig, eos_ids, hf_field, rope_field
from jaxllm.loader import Tensor, transpose, unchanged
from jaxllm.models.layers import MLP, DecoderLM

MODEL_TYPE = "sdar"


def config_from_hf(hf: dict) -> ModelConfig:
    field = lambda name, *aliases: hf_field(hf, name, MODEL_TYPE, *aliases)  # noqa: E731
    num_heads = field("num_attention_heads")
    head_dim = hf.get("head_dim") or field("hidden_size") // num_heads
    return ModelConfig(
        model_type=MODEL_TYPE,
        vocab_size=field("vocab_size"),
        hidden_size=field("hidden_size"),
        num_layers=field("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=field("num_key_value_heads"),
        head_dim=head_dim,
        intermediate_size=field("intermediate_size"),
        rms_norm_eps=field("rms_norm_eps"),
        rope_theta=rope_field(hf, "rope_theta", 1e6),
        rotary_dim=head_dim,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=field("max_position_embeddings"),
        default_block_size=int(hf.get("block_size", 4)),
        eos_token_ids=eos_ids(hf),
        mask_token_id=hf.get("mask_token_id"),
    )


class SDAR(DecoderLM):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, lambda _: MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs),
                         fused_qkv=False, dtype=dtype, rngs=rngs)


def hf_weight_map(cfg: ModelConfig) -> dict[str, Tensor]:
    """Model parameter path -> the checkpoint tensors it is made of."""
    per_layer = {
        "input_layernorm/weight": ("input_layernorm.weight", unchanged),
        "post_attention_layernorm/weight": ("post_attention_layernorm.weight", unchanged),
        "attn/q_proj/kernel": ("self_attn.q_proj.weight", transpose),
        "attn/k_proj/kernel": ("self_attn.k_proj.weight", transpose),
        "attn/v_proj/kernel": ("self_attn.v_proj.weight", transpose),
        "attn/o_proj/kernel": ("self_attn.o_proj.weight", transpose),
        "attn/q_norm/weight": ("self_attn.q_norm.weight", unchanged),
        "attn/k_norm/weight": ("self_attn.k_norm.weight", unchanged),
        "mlp/gate_proj/kernel": ("mlp.gate_proj.weight", transpose),
        "mlp/up_proj/kernel": ("mlp.up_proj.weight", transpose),
        "mlp/down_proj/kernel": ("mlp.down_proj.weight", transpose),
    }
    weights = {f"layers/{i}/{path}": Tensor((f"model.layers.{i}.{key}",), convert)
               for i in range(cfg.num_layers) for path, (key, convert) in per_layer.items()}
    weights["embed/embedding"] = Tensor(("model.embed_tokens.weight",), unchanged)
    weights["norm/weight"] = Tensor(("model.norm.weight",), unchanged)
    if not cfg.tie_word_embeddings:
        weights["lm_head/kernel"] = Tensor(("lm_head.weight",), transpose)
    return weights


# Checkpoint tensors that may be present but carry nothing this model reads.
IGNORED_KEYS = ("lm_head.weight",)
