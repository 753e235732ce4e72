"""The supported architectures, by config.json `model_type`, and how to build one from a checkpoint directory."""

import functools
import pathlib

import jax.numpy as jnp
from flax import nnx

from jaxllm.config import DTYPES, ConfigError, ModelConfig
from jaxllm.loader import load_weights, random_weights, read_config
from jaxllm.models import llada2, sdar

ARCHITECTURES = {
    sdar.MODEL_TYPE: (sdar, sdar.SDAR),
    llada2.MODEL_TYPE: (llada2, llada2.LLaDA2),
}


def _architecture(model_type: str):
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"config.json model_type {model_type!r} is not supported; "
                          f"supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def model_config(model_dir: pathlib.Path) -> ModelConfig:
    hf_config = read_config(model_dir)
    module, _ = _architecture(hf_config.get("model_type"))
    return module.config_from_hf(hf_config)


def abstract_model(cfg: ModelConfig, dtype: str) -> nnx.Module:
    _, model_class = _architecture(cfg.model_type)
    return nnx.eval_shape(lambda: model_class(cfg, dtype=jnp.dtype(DTYPES[dtype]), rngs=nnx.Rngs(0)))


def load_model(model_dir: pathlib.Path, cfg: ModelConfig, dtype: str, *, random_init: bool = False,
               quantization: str | None = None) -> nnx.Module:
    """The model with the checkpoint's weights (or random ones made on the device, for benchmarks)."""
    module, _ = _architecture(cfg.model_type)
    if quantization and not hasattr(module, "quantized"):
        raise ConfigError(f"quantization={quantization!r} is supported for MoE models; {cfg.model_type!r} is dense")
    abstract = abstract_model(cfg, dtype)
    # each tensor is quantized as it is made: the device never holds the whole model at the checkpoint's width
    convert = functools.partial(module.quantized, cfg, quantization) if quantization else None
    if random_init:
        return random_weights(abstract, convert=convert)
    return load_weights(model_dir, abstract, module.hf_weight_map(cfg), module.IGNORED_KEYS, convert=convert)
