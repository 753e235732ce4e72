"""Checkpoint loading: sharded and single-file checkpoints agree, and a checkpoint that does not fit its config
fails with one error that names the field or tensor."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm.config import ConfigError
from jaxllm.loader import CheckpointError
from jaxllm.models import load_model, model_config
from tools.make_checkpoint import make_checkpoint


def param_arrays(model) -> dict:
    import jax
    from flax import nnx
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]}


@pytest.fixture
def sdar_dir(checkpoints, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints("sdar"), path)
    return path


@pytest.mark.parametrize("arch", ["sdar", "llada2"])
def test_sharded_and_single_file_checkpoints_load_the_same_weights(tmp_path, arch):
    single = make_checkpoint(tmp_path / "single", arch, dtype="bf16", seed=5, num_shards=1)
    sharded = make_checkpoint(tmp_path / "sharded", arch, dtype="bf16", seed=5, num_shards=3)
    assert (sharded / "model.safetensors.index.json").exists()
    cfg = model_config(single)
    a, b = param_arrays(load_model(single, cfg, "bfloat16")), param_arrays(load_model(sharded, cfg, "bfloat16"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_missing_tensor_is_named(sdar_dir):
    weights = load_file(sdar_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, sdar_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(sdar_dir, model_config(sdar_dir), "float32")


def test_an_unexpected_tensor_is_named(sdar_dir):
    weights = load_file(sdar_dir / "model.safetensors")
    weights["model.layers.7.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, sdar_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"does not use.*model\.layers\.7\.mlp\.up_proj\.weight"):
        load_model(sdar_dir, model_config(sdar_dir), "float32")


def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(sdar_dir):
    config = json.loads((sdar_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    (sdar_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight \(128, 64\).*\(64, 192\)"):
        load_model(sdar_dir, model_config(sdar_dir), "float32")


def test_a_missing_config_field_is_named(sdar_dir):
    config = json.loads((sdar_dir / "config.json").read_text())
    del config["num_key_value_heads"]
    (sdar_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="lacks field 'num_key_value_heads'"):
        model_config(sdar_dir)


def test_an_unsupported_model_type_is_named(sdar_dir):
    config = json.loads((sdar_dir / "config.json").read_text())
    config["model_type"] = "dream"
    (sdar_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model_type 'dream' is not supported"):
        model_config(sdar_dir)
