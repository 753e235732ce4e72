"""Checkpoint loading: sharded and single-file checkpoints agree, and a checkpoint that does not fit its config
fails with one error that names the field or tensor."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm.config import ConfigError
from jaxllm.loader import CheckpointError, SafetensorsReader
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


def test_an_unexpected_tensor_is_named_before_any_tensor_is_read(sdar_dir, monkeypatch):
    weights = load_file(sdar_dir / "model.safetensors")
    weights["model.layers.7.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, sdar_dir / "model.safetensors")
    reads = []
    monkeypatch.setattr(SafetensorsReader, "get", lambda self, key, needed_by: reads.append(key))
    with pytest.raises(CheckpointError, match=r"does not use.*model\.layers\.7\.mlp\.up_proj\.weight"):
        load_model(sdar_dir, model_config(sdar_dir), "float32")
    assert reads == []


def test_a_shard_the_index_names_but_the_directory_lacks_is_named(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", "sdar", dtype="f32", num_shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lacks \['model-00002-of-00002\.safetensors'\], which model\."):
        load_model(path, model_config(path), "float32")


def test_llada2_without_a_router_expert_bias_loads_a_zero_one(checkpoints, tmp_path):
    """moe_router_enable_expert_bias=false: the reference gate selects on the scores alone, as a zero bias does."""
    source = checkpoints("llada2")
    shutil.copytree(source, tmp_path / "ckpt")
    path = tmp_path / "ckpt"
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.endswith("expert_bias")}, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"moe_router_enable_expert_bias": False}))
    with_bias, without = param_arrays(load_model(source, model_config(source), "float32")), \
        param_arrays(load_model(path, model_config(path), "float32"))
    biases = [key for key in without if key.endswith("['expert_bias']")]
    assert biases and all((without[key] == 0).all() and (with_bias[key] != 0).any() for key in biases)
    assert all(np.array_equal(with_bias[key], without[key]) for key in without if key not in biases)


def test_sdar_head_dim_defaults_to_128_as_its_config_class(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", "sdar", dtype="f32", hidden_size=256, head_dim=128)
    config = json.loads((path / "config.json").read_text())
    del config["head_dim"]  # hidden_size / heads would say 64
    (path / "config.json").write_text(json.dumps(config))
    assert model_config(path).head_dim == 128
    load_model(path, model_config(path), "float32")


@pytest.mark.parametrize("field, message", [
    ("hidden_size", r"input_layernorm\.weight \(64,\).*implies \(96,\) after conversion, the checkpoint gives \(64,\)"),
    ("intermediate_size", r"gate_proj\.weight \(128, 64\).*widths are \(128, 128\), config.json implies \(96, 96\)"),
])
def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(sdar_dir, field, message):
    config = json.loads((sdar_dir / "config.json").read_text())
    config[field] = 96
    (sdar_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_model(sdar_dir, model_config(sdar_dir), "float32")


def test_a_transposed_router_weight_is_named_with_its_checkpoint_shape(checkpoints, tmp_path):
    """The router is stored as bf16 pieces [H, 3E]; the error speaks of the checkpoint's [E, H]."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints("llada2"), path)
    weights = load_file(path / "model.safetensors")
    key = "model.layers.1.mlp.gate.weight"
    weights[key] = np.ascontiguousarray(weights[key].T)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"mlp\.gate\.weight \(64, 16\).*config\.json implies "
                                              r"\[num_experts, hidden_size\] = \(16, 64\)"):
        load_model(path, model_config(path), "float32")


def test_head_counts_that_disagree_with_the_checkpoint_are_named_even_when_the_widths_sum_the_same(sdar_dir):
    config = json.loads((sdar_dir / "config.json").read_text())
    config["num_attention_heads"], config["num_key_value_heads"] = 6, 1  # 6 + 2 * 1 heads, as 4 + 2 * 2
    (sdar_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"self_attn\.q_proj\.weight \(64, 64\).*widths are \(64, 32, 32\), "
                                              r"config.json implies \(96, 16, 16\)"):
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


@pytest.mark.parametrize(("arch", "setting", "message"), [
    ("sdar", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ("sdar", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling 'linear'"),
    ("llada2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 6e5, "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ("llada2", {"expert_capacity": 48}, "block routing"),
    ("llada2", {"norm_head": True}, "norm_head"),
    ("sdar", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("llada2", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
    ("sdar", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, r"pre-quantized .*fp8"),
    ("sdar", {"attention_bias": True}, "attention_bias=true"),
    ("llada2", {"use_qkv_bias": True}, "use_qkv_bias=true"),
    ("llada2", {"use_bias": True}, "use_bias=true"),
    ("llada2", {"use_qk_norm": False}, "use_qk_norm=false"),
])
def test_settings_the_models_do_not_implement_are_refused(checkpoints, tmp_path, arch, setting, message):
    """Loading them anyway would give a model that runs and is silently wrong."""
    config = json.loads((checkpoints(arch) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | setting))
    with pytest.raises(ConfigError, match=message):
        model_config(tmp_path)
    plain = config | {"rope_scaling": None, "expert_capacity": 0, "norm_head": False, "hidden_act": "silu",
                      "quantization_config": None, "attention_bias": False, "use_qkv_bias": False, "use_bias": False,
                      "use_qk_norm": True}
    (tmp_path / "config.json").write_text(json.dumps(plain))
    model_config(tmp_path)


@pytest.mark.parametrize(("arch", "field"), [("sdar", "rope_theta"), ("llada2", "rope_theta"), ("llada2", "n_group"),
                                             ("llada2", "topk_group"), ("llada2", "routed_scaling_factor")])
def test_fields_whose_defaults_differ_across_the_family_are_required(checkpoints, tmp_path, arch, field):
    """A guessed default would load a model that runs and is silently wrong (the config classes disagree)."""
    config = json.loads((checkpoints(arch) / "config.json").read_text())
    del config[field]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"lacks field '{field}'"):
        model_config(tmp_path)


@pytest.mark.parametrize(("setting", "message"), [
    ({"n_group": 3}, r"n_group=3 must split num_experts=16"),
    ({"n_group": 16}, r"n_group=16 must split num_experts=16 into equal groups of at least two"),
    ({"topk_group": 5}, r"topk_group=5 must lie in \[1, n_group=4\]"),
    ({"num_experts_per_tok": 12}, r"num_experts_per_tok=12 must lie in \[1, 8\]"),
])
def test_llada2_routing_the_reference_cannot_compute_is_named_before_the_weights_load(checkpoints, tmp_path,
                                                                                      setting, message):
    """Such a config once loaded every weight and failed at the first generate, naming no config.json field (and
    topk_group > n_group ran, where the reference's torch.topk raises)."""
    config = json.loads((checkpoints("llada2") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | setting))
    with pytest.raises(ConfigError, match=message):
        model_config(tmp_path)


def test_a_null_first_k_dense_replace_means_no_dense_layer(checkpoints, tmp_path):
    config = json.loads((checkpoints("llada2") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"first_k_dense_replace": None}))
    assert model_config(tmp_path).moe.first_k_dense_replace == 0


def test_a_shard_cut_short_is_named(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", "sdar", dtype="f32", num_shards=2)
    shard = path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])  # a download that stopped early
    with pytest.raises(CheckpointError, match=r"cannot read .*model-00002-of-00002\.safetensors"):
        load_model(path, model_config(path), "float32")


def test_an_index_that_names_the_wrong_shard_is_named(tmp_path):
    path = make_checkpoint(tmp_path / "ckpt", "sdar", dtype="f32", num_shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = next(f for k, f in index["weight_map"].items()
                                                    if f != index["weight_map"]["model.norm.weight"])
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"cannot read tensor 'model\.norm\.weight' from .*\.safetensors"):
        load_model(path, model_config(path), "float32")


def test_a_null_block_size_means_the_familys(sdar_dir):
    config = json.loads((sdar_dir / "config.json").read_text())
    (sdar_dir / "config.json").write_text(json.dumps(config | {"block_size": None}))
    assert model_config(sdar_dir).default_block_size == 4


def test_a_tensor_in_two_files_without_an_index_is_refused(sdar_dir):
    """Without model.safetensors.index.json every *.safetensors file is read: a leftover copy of a tensor must not
    silently replace the checkpoint's."""
    weights = load_file(sdar_dir / "model.safetensors")
    save_file({"model.embed_tokens.weight": np.zeros_like(weights["model.embed_tokens.weight"])},
              sdar_dir / "model.safetensors.old.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.embed_tokens\.weight' is in both"):
        load_model(sdar_dir, model_config(sdar_dir), "float32")


def _router_weights(params: dict) -> dict[int, np.ndarray]:
    """layer -> the router weight [H, E] its bf16 pieces [H, 3E] sum to, in float32 (exact)."""
    out = {}
    for key, pieces in params.items():
        if key.endswith("['mlp']['router_pieces']"):
            assert pieces.dtype == ml_dtypes.bfloat16
            hi, mid, lo = (p.astype(np.float32) for p in np.split(pieces, 3, axis=-1))
            out[int(key.split("][")[1])] = hi + mid + lo
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_llada2_router_pieces_are_cut_from_the_checkpoints_float32_weight(checkpoints, dtype):
    """Cut before the loader casts to the parameter's bf16: the pieces sum back to the float32 checkpoint tensor bit
    for bit (cut from a bf16 rounding, they would sum to that rounding)."""
    path = checkpoints("llada2")
    cfg = model_config(path)
    checkpoint = load_file(path / "model.safetensors")
    routers = _router_weights(param_arrays(load_model(path, cfg, dtype)))
    assert sorted(routers) == list(range(cfg.moe.first_k_dense_replace, cfg.num_layers)) and routers
    for layer, weight in routers.items():
        want = checkpoint[f"model.layers.{layer}.mlp.gate.weight"]
        assert want.dtype == np.float32 and (want != want.astype(ml_dtypes.bfloat16).astype(np.float32)).any()
        np.testing.assert_array_equal(weight, want.T)


def test_llada2_random_router_weights_are_cut_into_pieces(checkpoints):
    """Random weights for benchmarks: each router parameter is a float32 draw's pieces, not three unrelated draws."""
    path = checkpoints("llada2")
    params = param_arrays(load_model(path, model_config(path), "bfloat16", random_init=True))
    for key, pieces in params.items():
        if key.endswith("['router_pieces']"):
            hi, mid, lo = (p.astype(np.float32) for p in np.split(pieces, 3, axis=-1))
            assert 0.015 < hi.std() < 0.025 and (lo != 0).any(), key
            hi, mid, lo = np.abs(hi), np.abs(mid), np.abs(lo)
            assert (mid <= hi * 2.0 ** -7).all() and (lo <= mid * 2.0 ** -7).all(), key
