"""Load a Hugging Face checkpoint directory (config.json + safetensors, single file or sharded) into an NNX model.

Each model file declares `hf_weight_map(cfg)`: parameter path -> `Tensor` (which checkpoint keys, how to convert,
which layers and experts to stack). This module reads the tensors, checks every shape against the model built from
config.json, and reports a checkpoint that does not fit with one error naming the field or tensor.
"""

import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jaxllm.config import ConfigError
from jaxllm.quantization import cut_router_weight


class CheckpointError(ConfigError):
    """The checkpoint does not match its config.json; the message names the tensor."""


def transpose(weight):  # HF Linear [out, in] -> kernel [in, out]
    return weight.T


@dataclasses.dataclass(frozen=True)
class ConcatTransposed:
    """HF Linears [out_i, in] -> one kernel [in, sum out_i], in the order of the keys, where out_i must be widths[i]:
    the concatenated shape alone would pass q/k/v projections whose head counts differ from config.json's but sum the
    same."""

    widths: tuple[int, ...]

    def __call__(self, *weights):
        got = tuple(w.shape[0] for w in weights)
        if got != self.widths:
            raise ValueError(f"their output widths are {got}, config.json implies {self.widths}")
        return np.concatenate([w.T for w in weights], axis=1)

    def split(self, kernel):
        """The inverse: kernel [in, sum out_i] -> the HF tensors [out_i, in]."""
        return [piece.T for piece in np.split(kernel, np.cumsum(self.widths)[:-1], axis=1)]


def unchanged(weight):
    return weight


@dataclasses.dataclass(frozen=True)
class Tensor:
    """How one model parameter is assembled from checkpoint tensors."""

    keys: tuple[str, ...]  # checkpoint keys; "{expert}" is filled in when stacking experts
    convert: Callable[..., np.ndarray] = transpose  # the tensors of `keys`, in order -> the parameter (or a slice)
    experts: int | None = None  # stack this many experts on a leading axis


def _open_shard(path: pathlib.Path):
    try:
        return safe_open(path, framework="np")
    except SafetensorError as error:  # e.g. a download cut short: safetensors' message names no file
        raise CheckpointError(f"cannot read {path}: {error}") from None


class SafetensorsReader:
    """Random access to the tensors of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, model_dir: pathlib.Path):
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            key_to_file = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {model_dir}")
            key_to_file = {}
            for file in files:
                with _open_shard(file) as handle:
                    for key in handle.keys():
                        if key in key_to_file:  # a leftover copy: which one is the checkpoint is not ours to guess
                            raise CheckpointError(f"tensor {key!r} is in both {key_to_file[key]} and {file.name} "
                                                  f"(and {model_dir} has no model.safetensors.index.json)")
                        key_to_file[key] = file.name
        shards = set(key_to_file.values())
        absent = sorted(name for name in shards if not (model_dir / name).exists())
        if absent:
            raise CheckpointError(f"{model_dir} lacks {absent}, which model.safetensors.index.json names")
        self._handles = {name: _open_shard(model_dir / name) for name in shards}
        self._key_to_file = key_to_file
        self.model_dir = model_dir

    def keys(self) -> set[str]:
        return set(self._key_to_file)

    def get(self, key: str, needed_by: str) -> np.ndarray:
        if key not in self._key_to_file:
            raise CheckpointError(f"checkpoint {self.model_dir} lacks tensor {key!r} (needed for {needed_by})")
        file = self._key_to_file[key]
        try:
            return self._handles[file].get_tensor(key)
        except SafetensorError as error:  # e.g. the index names the wrong shard
            raise CheckpointError(f"cannot read tensor {key!r} from {self.model_dir / file}: {error}") from None


def read_config(model_dir: pathlib.Path) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        raise ConfigError(f"{model_dir} has no config.json; pass a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


def _assemble(path: str, spec: Tensor, reader: SafetensorsReader, shape, dtype) -> np.ndarray:
    def piece(fmt: dict, expected_shape) -> np.ndarray:
        keys = [key.format(**fmt) for key in spec.keys]
        tensors = [reader.get(key, path) for key in keys]
        shapes = ", ".join(f"{k} {tuple(t.shape)}" for k, t in zip(keys, tensors))
        try:
            value = spec.convert(*tensors)
        except ValueError as error:
            raise CheckpointError(f"tensor {shapes} does not fit parameter {path}: {error}") from None
        if value.shape != tuple(expected_shape):
            raise CheckpointError(f"tensor {shapes} does not fit parameter {path}: config.json implies "
                                  f"{tuple(expected_shape)} after conversion, the checkpoint gives {value.shape}")
        return value.astype(dtype)

    if spec.experts is None:
        return piece({}, shape)
    out = np.empty(shape, dtype)
    for expert in range(spec.experts):
        out[expert] = piece({"expert": expert}, shape[1:])
    return out


def _flat_params(state) -> dict[str, jax.ShapeDtypeStruct]:
    flat = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
        flat["/".join(str(k.key) for k in key_path)] = leaf
    return flat


def _unflatten(flat: dict[str, object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = (int(name) if name.isdigit() else name for name in path.split("/"))  # list indices
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


def load_weights(model_dir: pathlib.Path, abstract_model: nnx.Module, weight_map: dict[str, Tensor],
                 ignored_keys: tuple[str, ...] = (), convert=None) -> nnx.Module:
    """Fill an abstract (eval_shape) model from the checkpoint. convert(path, array) -> value, if given, turns each
    tensor into what the model stores (e.g. quantized experts) as it arrives, so the device never holds the whole
    model in the checkpoint's dtype."""
    graphdef, state = nnx.split(abstract_model)
    params = _flat_params(state)
    if set(params) != set(weight_map):
        raise AssertionError(f"weight map and model disagree: {sorted(set(params) ^ set(weight_map))}")
    reader = SafetensorsReader(model_dir)
    # the key sets are compared before any tensor is read: a mismatch fails in a moment, not after gigabytes
    used = set().union(*map(_used_keys, weight_map.values()))
    unexpected = sorted(reader.keys() - used - set(ignored_keys))
    if unexpected:
        raise CheckpointError(f"checkpoint {model_dir} has {len(unexpected)} tensors that this model does not use, "
                              f"e.g. {unexpected[:3]}; does config.json match the weights?")
    loaded = {}
    for path, spec in weight_map.items():
        struct = params[path]
        host = _assemble(path, spec, reader, struct.shape, np.dtype(struct.dtype))
        # no name keeps the device copy: converted, it is freed before the next tensor is sent
        loaded[path] = convert(path, jnp.asarray(host)) if convert else jnp.asarray(host)
    nnx.replace_by_pure_dict(state, _unflatten(loaded))
    return nnx.merge(graphdef, state)


def _used_keys(spec: Tensor) -> set[str]:
    experts = range(spec.experts) if spec.experts is not None else (None,)
    return {key.format(expert=expert) for key in spec.keys for expert in experts}


def random_weights(abstract_model: nnx.Module, seed: int = 0, std: float = 0.02, convert=None) -> nnx.Module:
    """Fill an abstract model with random weights made on the device (for full-size benchmarks); convert as in
    load_weights."""
    graphdef, state = nnx.split(abstract_model)
    params = _flat_params(state)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def make(key, shape, dtype):
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    keys = jax.random.split(jax.random.key(seed), len(params))
    filled = {}
    for key, (path, struct) in zip(keys, sorted(params.items())):
        if path.endswith("weight"):  # norm weights: near one
            filled[path] = (1.0 + make(key, struct.shape, jnp.float32)).astype(struct.dtype)
        elif path.endswith("expert_bias"):
            filled[path] = jnp.abs(make(key, struct.shape, struct.dtype))
        elif path.endswith("router_pieces"):  # a float32 weight [H, E] cut into its bf16 pieces [H, 3E]
            filled[path] = cut_router_weight(make(key, (*struct.shape[:-1], struct.shape[-1] // 3), jnp.float32))
        else:
            filled[path] = make(key, struct.shape, struct.dtype)
        if convert:
            filled[path] = convert(path, filled[path])
    nnx.replace_by_pure_dict(state, _unflatten(filled))
    return nnx.merge(graphdef, state)
