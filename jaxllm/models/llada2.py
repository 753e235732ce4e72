"""LLaDA2.0 / 2.1 (inclusionAI): the BailingMoeV2 architecture trained for block diffusion.

Fused QKV, per-head QK RMSNorm, partial RoPE (the first half of each head), the first `first_k_dense_replace`
layers dense and the rest MoE: a float32 sigmoid router whose expert bias steers selection only, group-limited
top-k, top-k weights normalised and scaled by routed_scaling_factor, plus shared experts. Block-causal attention,
in-place logits.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ConfigError, ModelConfig, MoEConfig, hf_field, transformer_config
from jaxllm.kernels.moe import moe_experts, route_grouped_sigmoid
from jaxllm.loader import ConcatTransposed, Tensor, transpose, unchanged
from jaxllm.models.layers import MLP, DecoderLM, normal_init, router_matmul
from jaxllm.quantization import cut_router_weight, quantize

MODEL_TYPE = "llada2_moe"


def config_from_hf(hf: dict) -> ModelConfig:
    def field(name):
        return hf_field(hf, name, MODEL_TYPE)

    if hf.get("score_function", "sigmoid") != "sigmoid":
        raise ConfigError(f"score_function {hf['score_function']!r} is not supported; LLaDA2 routes with 'sigmoid'")
    if hf.get("expert_capacity"):
        raise ConfigError(f"expert_capacity={hf['expert_capacity']} (LLaDA2.2 block routing) is not supported: only "
                          f"grouped top-k routing")
    if hf.get("norm_head"):
        raise ConfigError("norm_head=true (a normalised LM head) is not supported")
    for flag in ("use_qkv_bias", "use_bias"):  # else the load fails on 'unused' bias tensors
        if hf.get(flag):
            raise ConfigError(f"{flag}=true (biased attention projections) is not supported")
    if not hf.get("use_qk_norm", True):
        raise ConfigError("use_qk_norm=false is not supported: the attention normalises q and k per head")
    moe = MoEConfig(
        num_experts=field("num_experts"),
        num_experts_per_tok=field("num_experts_per_tok"),
        moe_intermediate_size=field("moe_intermediate_size"),
        num_shared_experts=int(hf.get("num_shared_experts") or 0),
        first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
        # required: a guess routes every token differently, and config classes of the family default them
        # differently (the reference's 8, 4, 2.5 against a plain top-k's 1, 1, 1)
        n_group=int(field("n_group")),
        topk_group=int(field("topk_group")),
        routed_scaling_factor=float(field("routed_scaling_factor")),
        expert_bias=bool(hf.get("moe_router_enable_expert_bias", True)),
    )
    _check_routing(moe)
    return transformer_config(hf, MODEL_TYPE, partial_rotary_factor=0.5, block_size=32, moe=moe)


def _check_routing(moe: MoEConfig) -> None:
    """Group-limited top-k as the reference computes it, checked before the weights load: a group scores its top two
    experts, the top topk_group groups stay, and the top num_experts_per_tok of their experts are chosen."""
    if moe.n_group < 1 or moe.num_experts % moe.n_group or moe.num_experts // moe.n_group < 2:
        raise ConfigError(f"config.json n_group={moe.n_group} must split num_experts={moe.num_experts} into equal "
                          f"groups of at least two experts")
    if not 1 <= moe.topk_group <= moe.n_group:
        raise ConfigError(f"config.json topk_group={moe.topk_group} must lie in [1, n_group={moe.n_group}]")
    kept = moe.topk_group * (moe.num_experts // moe.n_group)
    if not 1 <= moe.num_experts_per_tok <= kept:
        raise ConfigError(f"config.json num_experts_per_tok={moe.num_experts_per_tok} must lie in [1, {kept}], the "
                          f"experts of topk_group={moe.topk_group} groups")


class SparseMoE(nnx.Module):
    """Routed experts plus shared experts on a flat token axis."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        moe = self.moe = cfg.moe
        width = moe.moe_intermediate_size
        # the float32 router weight [H, E] as its bf16 pieces [H, 3E], cut once here rather than in each forward
        self.router_pieces = nnx.Param(cut_router_weight(
            normal_init(rngs, (cfg.hidden_size, moe.num_experts), jnp.float32).get_value()))
        self.expert_bias = nnx.Param(jnp.zeros((moe.num_experts,), jnp.float32))
        self.experts_gate_up = normal_init(rngs, (moe.num_experts, cfg.hidden_size, 2 * width), dtype)
        self.experts_down = normal_init(rngs, (moe.num_experts, width, cfg.hidden_size), dtype)
        self.shared_experts = (MLP(cfg.hidden_size, width * moe.num_shared_experts, dtype=dtype, rngs=rngs)
                               if moe.num_shared_experts else None)
        self.batch_invariant = False  # the router's GEMM and the expert kernels (see layers.Linear)

    def __call__(self, x, norm: nnx.Module):  # experts over norm(x): the router and the kernels read it normalised
        x = norm(x)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, expert_ids = route_grouped_sigmoid(
            router_matmul(flat, self.router_pieces[...], batch_invariant=self.batch_invariant), self.expert_bias[...],
            top_k=self.moe.num_experts_per_tok, n_group=self.moe.n_group, topk_group=self.moe.topk_group,
            batch_invariant=self.batch_invariant,
            # as the reference gate: top-k weights normalised whenever top_k > 1, whatever norm_topk_prob says
            routed_scaling_factor=self.moe.routed_scaling_factor, norm_topk_prob=self.moe.num_experts_per_tok > 1)
        self.sow(nnx.Intermediate, "expert_ids", expert_ids)  # routing statistics; dead code unless popped
        # the kernels may run the shared expert beside the routed ones
        shared = None if self.shared_experts is None else (self.shared_experts.gate_up_proj.kernel[...],
                                                          self.shared_experts.down_proj.kernel[...])
        out = moe_experts(flat, expert_ids, weights, self.experts_gate_up.get_value(), self.experts_down.get_value(),
                          shared=shared, batch_invariant=self.batch_invariant)
        return out.reshape(shape)


class LLaDA2(DecoderLM):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        def make_mlp(layer: int) -> nnx.Module:
            if layer < cfg.moe.first_k_dense_replace:
                return MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
            return SparseMoE(cfg, dtype=dtype, rngs=rngs)

        super().__init__(cfg, make_mlp, dtype=dtype, rngs=rngs)


_EXPERT_WEIGHTS = re.compile(r"layers/(\d+)/mlp/experts_(gate_up|down)")


def quantized(cfg: ModelConfig, mode: str, path: str, value: jax.Array):
    """A parameter as the model stores it under load-time quantization: the routed experts (nearly all of the weight
    bytes) become int8 or fp8, stored channel-major (the layout the MoE kernels read 1-byte tiles from with ldmatrix;
    see kernels/moe.py); every other parameter is kept as it is."""
    match = _EXPERT_WEIGHTS.fullmatch(path)
    if match and int(match.group(1)) >= cfg.moe.first_k_dense_replace:
        return _quantize_channel_major(value, mode)
    return value


@functools.partial(jax.jit, static_argnums=1)
def _quantize_channel_major(weight, mode):
    return quantize(weight, mode, channel_major=True)


@dataclasses.dataclass(frozen=True)
class RouterPiecesFromHF:
    """HF router weight [E, H] -> bf16 pieces [H, 3E], cut from the checkpoint's float32 (the loader's cast to the
    parameter's bf16 leaves them as they are). The HF shape is checked here: a mismatch is named as the checkpoint
    spells it, not as the pieces' [H, 3E]."""

    shape: tuple[int, int]  # [num_experts, hidden_size]

    def __call__(self, gate_weight: np.ndarray) -> np.ndarray:
        if gate_weight.shape != self.shape:
            raise ValueError(f"config.json implies [num_experts, hidden_size] = {self.shape}")
        return np.asarray(cut_router_weight(jnp.asarray(gate_weight.T, jnp.float32)))


def hf_weight_map(cfg: ModelConfig) -> dict[str, Tensor]:
    """Model parameter path -> the checkpoint tensors it is made of."""
    attention = {
        "input_layernorm/weight": (("input_layernorm.weight",), unchanged),
        "post_attention_layernorm/weight": (("post_attention_layernorm.weight",), unchanged),
        "attn/qkv_proj/kernel": (("attention.query_key_value.weight",), transpose),  # rows: q heads, k heads, v heads
        "attn/o_proj/kernel": (("attention.dense.weight",), transpose),
        "attn/q_norm/weight": (("attention.query_layernorm.weight",), unchanged),
        "attn/k_norm/weight": (("attention.key_layernorm.weight",), unchanged),
    }

    def swiglu(module, width):  # an MLP's parameters; its checkpoint keys spell the module path with dots
        key = module.replace("/", ".")
        return {f"{module}/gate_up_proj/kernel": ((f"{key}.gate_proj.weight", f"{key}.up_proj.weight"),
                                                 ConcatTransposed((width, width))),
                f"{module}/down_proj/kernel": ((f"{key}.down_proj.weight",), transpose)}

    moe_mlp = {
        "mlp/router_pieces": (("mlp.gate.weight",), RouterPiecesFromHF((cfg.moe.num_experts, cfg.hidden_size))),
        # without one, a zero bias selects as the reference's biasless gate does
        "mlp/expert_bias": ((("mlp.gate.expert_bias",), unchanged) if cfg.moe.expert_bias else
                            ((), lambda: np.zeros((cfg.moe.num_experts,), np.float32))),
        "mlp/experts_gate_up": (("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"),
                                ConcatTransposed((cfg.moe.moe_intermediate_size,) * 2)),
        "mlp/experts_down": (("mlp.experts.{expert}.down_proj.weight",), transpose),
    }
    if cfg.moe.num_shared_experts:
        moe_mlp |= swiglu("mlp/shared_experts", cfg.moe.moe_intermediate_size * cfg.moe.num_shared_experts)
    weights = {}
    for i in range(cfg.num_layers):
        mlp = swiglu("mlp", cfg.intermediate_size) if i < cfg.moe.first_k_dense_replace else moe_mlp
        for path, (keys, convert) in (attention | mlp).items():
            experts = cfg.moe.num_experts if any("{expert}" in key for key in keys) else None
            weights[f"layers/{i}/{path}"] = Tensor(tuple(f"model.layers.{i}.{k}" for k in keys), convert, experts)
    weights["embed/embedding"] = Tensor(("model.word_embeddings.weight",), unchanged)
    weights["norm/weight"] = Tensor(("model.norm.weight",), unchanged)
    if not cfg.tie_word_embeddings:
        weights["lm_head/kernel"] = Tensor(("lm_head.weight",), transpose)
    return weights


IGNORED_KEYS = ("lm_head.weight",)
