"""Configuration: what a checkpoint is (ModelConfig) and how the engine runs it (EngineConfig, DecodingConfig).

Model-intrinsic facts (shapes, block size a model was trained with, mask id) come from config.json and the
tokenizer; runtime knobs (strategy, thresholds, limits) come from the user. One flag is one field, validated at
construction with an error that names the field.
"""

import dataclasses
import pathlib
from typing import Any, Literal


class ConfigError(ValueError):
    """A checkpoint or engine configuration that cannot be used; the message names the field."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    expert_bias: bool = True  # False: the checkpoint has no router expert bias, so selection uses the scores alone


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int  # leading dims of each head that RoPE rotates; the rest pass through
    tie_word_embeddings: bool
    max_position_embeddings: int
    default_block_size: int  # the block size the model was trained with
    eos_token_ids: tuple[int, ...]
    mask_token_id: int | None = None  # None: resolved from the tokenizer at load
    moe: MoEConfig | None = None


def transformer_config(hf_config: dict, model_type: str, *, partial_rotary_factor: float, block_size: int,
                       default_head_dim: int | None = None, moe: MoEConfig | None = None) -> ModelConfig:
    """The fields every supported decoder reads the same way; the defaults are the model family's (default_head_dim
    None: hidden_size / num_attention_heads when config.json leaves it out)."""
    def field(name):
        return hf_field(hf_config, name, model_type)

    quantized = hf_config.get("quantization_config")
    if quantized:  # else the load fails on "unused" scale tensors, which does not say why
        method = quantized.get("quant_method", "quantization_config")
        raise ConfigError(f"pre-quantized checkpoints ({method}) are not supported: load an unquantized one "
                          f"(LLaDA2's experts quantize at load: quantization='int8' or 'fp8')")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf_config['hidden_act']!r} is not supported: the MLPs are SwiGLU (silu)")

    scaling = {**(hf_config.get("rope_parameters") or {}), **(hf_config.get("rope_scaling") or {})}
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ConfigError(f"RoPE scaling {rope_type!r} is not supported: only plain RoPE (a {model_type!r} checkpoint "
                          f"with it would get wrong positions)")
    num_heads = field("num_attention_heads")
    head_dim = hf_config.get("head_dim") or default_head_dim or field("hidden_size") // num_heads
    return ModelConfig(
        model_type=model_type,
        vocab_size=field("vocab_size"),
        hidden_size=field("hidden_size"),
        num_layers=field("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=field("num_key_value_heads"),
        head_dim=head_dim,
        intermediate_size=field("intermediate_size"),
        rms_norm_eps=field("rms_norm_eps"),
        # required: the families' config classes default it differently from their released checkpoints
        rope_theta=rope_field(hf_config, "rope_theta", model_type),
        rotary_dim=int(head_dim * rope_field(hf_config, "partial_rotary_factor", model_type, partial_rotary_factor)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        max_position_embeddings=field("max_position_embeddings"),
        default_block_size=int(hf_config.get("block_size") or block_size),  # null: the family's
        eos_token_ids=eos_ids(hf_config),
        mask_token_id=hf_config.get("mask_token_id"),
        moe=moe,
    )


def hf_field(hf_config: dict, name: str, model_type: str, *aliases: str):
    """Read a required config.json field, accepting older aliases, with an error that names it."""
    for key in (name, *aliases):
        if key in hf_config and hf_config[key] is not None:
            return hf_config[key]
    raise ConfigError(f"config.json lacks field {name!r}, which a {model_type!r} checkpoint needs")


def rope_field(hf_config: dict, name: str, model_type: str, default: float | None = None) -> float:
    """RoPE settings sit at the top level (older exports) or in `rope_parameters` (transformers 5); without a
    default the field is required."""
    nested = hf_config.get("rope_parameters") or {}
    value = hf_config.get(name) or nested.get(name) or default
    return float(value if value is not None else hf_field(hf_config, name, model_type))


def eos_ids(hf_config: dict) -> tuple[int, ...]:
    eos = hf_config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


Strategy = Literal["threshold", "fixed_steps", "joint_threshold"]

# LLaDA2.1 presets (decoding.md §7): Speed writes any differing candidate (editing_threshold 0.0).
JOINT_THRESHOLD_PRESETS = {
    "quality": dict(threshold=0.7, editing_threshold=0.5, max_post_steps=16),
    "speed": dict(threshold=0.5, editing_threshold=0.0, max_post_steps=16),
}


@dataclasses.dataclass(frozen=True)
class DecodingConfig:
    """How a block is denoised. Knobs that the chosen strategy does not read must stay None."""

    strategy: Strategy = "threshold"
    threshold: float | None = None  # threshold / joint_threshold: commit masked positions with confidence >= this
    denoising_steps: int | None = None  # fixed_steps: steps per block (None: the block size, one token a step)
    editing_threshold: float | None = None  # joint_threshold: rewrite a filled token when its new candidate beats this
    max_post_steps: int | None = None  # joint_threshold: editing steps allowed after a block has no masks
    buffer_size: int = 1  # blocks in flight per request
    add_block_threshold: float | None = None  # buffer_size > 1: open the next block at this fraction unmasked
    semi_complete_threshold: float | None = None  # buffer_size > 1: force top-1 once the previous block is this full

    @classmethod
    def joint_threshold_preset(cls, name: str, **overrides) -> "DecodingConfig":
        """LLaDA2.1's Quality ("quality") or Speed ("speed") joint_threshold settings, with overrides (None: the
        preset's, as for a flag left out)."""
        if name not in JOINT_THRESHOLD_PRESETS:
            raise ConfigError(f"preset must be one of {sorted(JOINT_THRESHOLD_PRESETS)}, got {name!r}")
        overrides = {knob: value for knob, value in overrides.items() if value is not None}
        return cls(strategy="joint_threshold", **(JOINT_THRESHOLD_PRESETS[name] | overrides))

    def __post_init__(self):
        uses = {
            "threshold": {"threshold"},
            "fixed_steps": {"denoising_steps"},
            "joint_threshold": {"threshold", "editing_threshold", "max_post_steps"},
        }
        if self.strategy not in uses:
            raise ConfigError(f"decoding_strategy must be one of {sorted(uses)}, got {self.strategy!r}")
        defaults = {"threshold": 0.95, "denoising_steps": None, "editing_threshold": 0.5, "max_post_steps": 16}
        for knob, default in defaults.items():
            value = getattr(self, knob)
            if knob not in uses[self.strategy] and value is not None:
                raise ConfigError(f"{knob}={value!r} has no effect with decoding_strategy={self.strategy!r}")
            if knob in uses[self.strategy] and value is None:
                object.__setattr__(self, knob, default)
        if self.buffer_size < 1:
            raise ConfigError(f"buffer_size must be >= 1, got {self.buffer_size}")
        for knob, default in (("add_block_threshold", 0.1), ("semi_complete_threshold", 0.9)):
            value = getattr(self, knob)
            if self.buffer_size == 1 and value is not None:
                raise ConfigError(f"{knob}={value!r} needs buffer_size > 1")
            if knob == "semi_complete_threshold" and self.strategy == "fixed_steps":
                if value is not None:  # its schedule already commits a fixed count in every active block
                    raise ConfigError(f"{knob}={value!r} has no effect with decoding_strategy='fixed_steps'")
            elif self.buffer_size > 1 and value is None:
                object.__setattr__(self, knob, default)
        for knob in ("threshold", "editing_threshold", "add_block_threshold", "semi_complete_threshold"):
            value = getattr(self, knob)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"{knob} must lie in [0, 1], got {value}")
        if self.denoising_steps is not None and self.denoising_steps < 1:
            raise ConfigError(f"denoising_steps must be >= 1, got {self.denoising_steps}")
        if self.max_post_steps is not None and self.max_post_steps < 0:
            raise ConfigError(f"max_post_steps must be >= 0, got {self.max_post_steps}")


# option spelling -> dtype name (jnp.dtype(name) is the array dtype); names, so the command line validates options
# without importing JAX
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "f32": "float32"}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Runtime limits and layout. block_size/page_size None: the model's trained block size."""

    block_size: int | None = None
    page_size: int | None = None
    dtype: str = "bfloat16"
    quantization: Literal["int8", "fp8"] | None = None
    max_num_seqs: int = 8
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 4096
    max_num_batched_tokens: int = 2048  # tokens per prefill step
    num_pages: int | None = None  # KV pool size; None: sized from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    max_steps_per_round: int | None = None  # denoising steps per device call; None: enough to finish a block
    # the LM head and sampler run on the window positions a step reads, padded to a quarter, a half, three quarters or
    # all of the batch's rows, a part no smaller than this (or none when no position is read): below it the LM head's
    # weight read bounds it (H200: ~200 rows), so fewer rows save nothing
    min_logit_rows: int = 256
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    # seconds a request may wait to be scheduled (from add_request); later it finishes "queue_timeout". None: no limit
    max_queue_time: float | None = None
    compilation_cache_dir: str | None = None
    mask_token_id: int | None = None  # override the checkpoint's mask id
    seed: int = 0  # draws seeds for requests that bring none
    # a request's arithmetic the same alone or in any batch, so its tokens are too, in bf16 as well: every GEMM, the
    # attention and the expert kernels tiled alike at any row count (kernels/matmul.py, kernels/rms_norm.py), and a
    # context prefilled in the pieces it would have alone, after a cache hit or a preemption too
    # (SchedulerConfig.fixed_prefill_chunks). LLaDA2 on the H100: +21% at batch 1, +13% at batch 32 (BENCHMARKS.md,
    # runs 50 and 51)
    batch_invariant: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, "int8", "fp8"):
            raise ConfigError(f"quantization must be None, 'int8' or 'fp8', got {self.quantization!r}")
        for knob in ("block_size", "page_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
                     "num_pages", "max_steps_per_round", "max_waiting_requests", "min_logit_rows"):
            value = getattr(self, knob)
            if value is not None and value < 1:
                raise ConfigError(f"{knob} must be >= 1, got {value}")
        if self.max_queue_time is not None and not self.max_queue_time > 0:
            raise ConfigError(f"max_queue_time must be > 0 seconds, got {self.max_queue_time}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")


DEFAULT_MODEL_DIR = pathlib.Path(__file__).parent / "default_model"  # the embedded model `LLM()` loads

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
_DECODING_FIELDS = {f.name for f in dataclasses.fields(DecodingConfig)}


def split_options(options: dict[str, Any]) -> tuple[EngineConfig, DecodingConfig]:
    """Route keyword options to EngineConfig or DecodingConfig; an unknown option is an error.

    decoding_preset ("quality" or "speed") starts from LLaDA2.1's joint_threshold settings; explicit decoding
    options override them."""
    options = dict(options)
    if "decoding_strategy" in options:
        options["strategy"] = options.pop("decoding_strategy")
    preset = options.pop("decoding_preset", None)
    unknown = set(options) - _ENGINE_FIELDS - _DECODING_FIELDS
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}")
    engine = EngineConfig(**{k: v for k, v in options.items() if k in _ENGINE_FIELDS})
    decoding_options = {k: v for k, v in options.items() if k in _DECODING_FIELDS}
    if preset is None:
        return engine, DecodingConfig(**decoding_options)
    if decoding_options.pop("strategy", "joint_threshold") != "joint_threshold":
        raise ConfigError(f"decoding_preset={preset!r} is a joint_threshold preset; it takes no other strategy")
    return engine, DecodingConfig.joint_threshold_preset(preset, **decoding_options)
