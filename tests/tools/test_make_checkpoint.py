"""The committed project tokenizer and the random HF-format checkpoints that tests and benchmarks load."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from tools.make_checkpoint import make_checkpoint

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "jaxllm" / "default_model"
EOS_ID, MASK_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def read_tensors(checkpoint: Path) -> dict[str, tuple[tuple[int, ...], str, Path]]:
    """key -> (shape, safetensors dtype, file) over every safetensors file in the directory."""
    tensors = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(path, framework="np") as f:
            stored_keys = f.keys()
            for key in stored_keys:
                assert key not in tensors, f"{key} stored twice"
                tensor_slice = f.get_slice(key)
                tensors[key] = (tuple(tensor_slice.get_shape()), tensor_slice.get_dtype(), path)
    return tensors


def load_f32(checkpoint: Path, key: str) -> np.ndarray:
    with safe_open(checkpoint / "model.safetensors", framework="np") as f:
        return f.get_tensor(key)


def expected_sdar_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    d, h, v, ffn = config["head_dim"], config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    expected = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (v, h)
    for n in range(config["num_hidden_layers"]):
        layer = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (nq * d, h), "self_attn.k_proj.weight": (nkv * d, h),
            "self_attn.v_proj.weight": (nkv * d, h), "self_attn.o_proj.weight": (h, nq * d),
            "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
            "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn),
        }
        expected |= {f"model.layers.{n}.{key}": shape for key, shape in layer.items()}
    return expected


def expected_llada2_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    d, h, v = config["head_dim"], config["hidden_size"], config["vocab_size"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    num_experts, expert_ffn = config["num_experts"], config["moe_intermediate_size"]
    expected = {"model.word_embeddings.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        layer = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "attention.query_key_value.weight": ((nq + 2 * nkv) * d, h), "attention.dense.weight": (h, nq * d),
            "attention.query_layernorm.weight": (d,), "attention.key_layernorm.weight": (d,),
        }
        if n < config["first_k_dense_replace"]:
            ffn = config["intermediate_size"]
            layer |= {"mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h),
                      "mlp.down_proj.weight": (h, ffn)}
        else:
            shared_ffn = expert_ffn * config["num_shared_experts"]
            layer |= {"mlp.gate.weight": (num_experts, h), "mlp.gate.expert_bias": (num_experts,),
                      "mlp.shared_experts.gate_proj.weight": (shared_ffn, h),
                      "mlp.shared_experts.up_proj.weight": (shared_ffn, h),
                      "mlp.shared_experts.down_proj.weight": (h, shared_ffn)}
            for e in range(num_experts):
                layer |= {f"mlp.experts.{e}.gate_proj.weight": (expert_ffn, h),
                          f"mlp.experts.{e}.up_proj.weight": (expert_ffn, h),
                          f"mlp.experts.{e}.down_proj.weight": (h, expert_ffn)}
        expected |= {f"model.layers.{n}.{key}": shape for key, shape in layer.items()}
    return expected


def test_tokenizer_loads_fast_with_eos_pad_and_mask_at_documented_ids(tokenizer):
    assert tokenizer.is_fast
    assert len(tokenizer) == 8000
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|endoftext|>", EOS_ID)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", EOS_ID)
    assert (tokenizer.mask_token, tokenizer.mask_token_id) == ("<|mask|>", MASK_ID)
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START_ID, IM_END_ID]


@pytest.mark.parametrize("text", [
    "def add(a, b):\n    return a + b  # sum\n",
    "  two leading spaces,\ttabs\tand trailing spaces  \n\n",
    "中文分词测试，日本語のテキスト。",
    "emoji 🤖👍🏽 and a family 👨‍👩‍👧 ok",
    "mixed: naïve café — ½ ∑ x² \u00a0 \U0001f600",
])
def test_any_utf8_text_round_trips_exactly(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_compresses_python_source(tokenizer):
    text = "for index, value in enumerate(values):\n    if value is None:\n        raise ValueError(index)\n"
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text.encode()) / 2.5


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 你好<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == expected + "<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == IM_START_ID and ids.count(IM_START_ID) == 3 and ids.count(IM_END_ID) == 2


def test_chat_template_joins_openai_text_parts(tokenizer):
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert rendered == "<|im_start|>user\nHello, world<|im_end|>\n"


@pytest.mark.parametrize("arch, expected_shapes, overrides", [
    ("sdar", expected_sdar_shapes, {}),
    ("sdar", expected_sdar_shapes, {"tie_word_embeddings": True}),
    ("llada2", expected_llada2_shapes, {}),
    ("llada2", expected_llada2_shapes, {"num_hidden_layers": 2, "num_experts": 8, "n_group": 2}),
])
def test_tiny_checkpoint_has_exactly_the_hf_keys_and_shapes(tmp_path, arch, expected_shapes, overrides):
    checkpoint = make_checkpoint(tmp_path / arch, arch, size="tiny", dtype="bf16", **overrides)
    config = json.loads((checkpoint / "config.json").read_text())
    assert {key: config[key] for key in overrides} == overrides
    tensors = read_tensors(checkpoint)
    assert {key: shape for key, (shape, _, _) in tensors.items()} == expected_shapes(config)
    for key, (_, dtype, _) in tensors.items():
        assert dtype == ("F32" if key.endswith("expert_bias") else "BF16"), key
    assert config["torch_dtype"] == "bfloat16"


def test_checkpoint_configs_name_the_architecture_and_tokenizer_ids(tmp_path):
    sdar = json.loads((make_checkpoint(tmp_path / "sdar", "sdar") / "config.json").read_text())
    llada2 = json.loads((make_checkpoint(tmp_path / "llada2", "llada2") / "config.json").read_text())
    assert (sdar["model_type"], sdar["architectures"]) == ("sdar", ["SDARForCausalLM"])
    assert (llada2["model_type"], llada2["architectures"]) == ("llada2_moe", ["LLaDA2MoeModelLM"])
    for config in (sdar, llada2):
        assert (config["vocab_size"], config["eos_token_id"], config["pad_token_id"]) == (8192, EOS_ID, EOS_ID)
    generation = json.loads((tmp_path / "llada2" / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == {EOS_ID, IM_END_ID}


def test_checkpoint_directory_carries_a_loadable_tokenizer(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", "llada2")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert (tokenizer.mask_token_id, len(tokenizer)) == (MASK_ID, 8000)


def test_random_weights_are_scaled_and_norms_are_not_trivial(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", "llada2", dtype="f32")
    matrix = load_f32(checkpoint, "model.layers.1.mlp.experts.3.up_proj.weight")
    assert 0.015 < matrix.std() < 0.025 and abs(matrix.mean()) < 0.005
    norm = load_f32(checkpoint, "model.layers.0.attention.query_layernorm.weight")
    assert abs(norm.mean() - 1) < 0.1 and 0.03 < norm.std() < 0.3
    expert_bias = load_f32(checkpoint, "model.layers.2.mlp.gate.expert_bias")
    assert expert_bias.dtype == np.float32 and (expert_bias > 0).all() and (expert_bias < 0.1).all()
    other_expert = load_f32(checkpoint, "model.layers.1.mlp.experts.4.up_proj.weight")
    assert not np.array_equal(matrix, other_expert)


def test_sharded_checkpoint_index_maps_every_key_to_the_file_holding_it(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", "llada2", num_shards=3)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    tensors = read_tensors(checkpoint)
    assert len({path for _, _, path in tensors.values()}) == 3
    assert not (checkpoint / "model.safetensors").exists()
    assert index["weight_map"] == {key: path.name for key, (_, _, path) in tensors.items()}
    dtype_bytes = {"F32": 4, "BF16": 2}
    assert index["metadata"]["total_size"] == sum(
        int(np.prod(shape)) * dtype_bytes[dtype] for shape, dtype, _ in tensors.values())


def test_rewriting_a_directory_with_one_shard_drops_the_old_shards(tmp_path):
    make_checkpoint(tmp_path / "ckpt", "sdar", num_shards=2)
    checkpoint = make_checkpoint(tmp_path / "ckpt", "sdar", num_shards=1)
    assert [path.name for path in checkpoint.glob("*.safetensors")] == ["model.safetensors"]
    assert not (checkpoint / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("arch", ["sdar", "llada2"])
def test_same_seed_gives_identical_bytes_and_another_seed_does_not(tmp_path, arch):
    def weight_bytes(name: str, seed: int) -> bytes:
        return (make_checkpoint(tmp_path / name, arch, seed=seed) / "model.safetensors").read_bytes()

    first = weight_bytes("first", seed=7)
    assert weight_bytes("again", seed=7) == first
    assert weight_bytes("other", seed=8) != first


def test_unknown_config_override_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="num_layers"):
        make_checkpoint(tmp_path / "ckpt", "sdar", num_layers=2)
