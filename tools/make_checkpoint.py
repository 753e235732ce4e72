"""Write random-weight checkpoints in Hugging Face format for SDAR (Qwen3 keys) and LLaDA2 (BailingMoeV2 keys).

A checkpoint directory holds config.json, generation_config.json, the weights as safetensors (one file, or shards
with model.safetensors.index.json) and a copy of the project tokenizer from jaxllm/default_model. Config field names
and tensor keys follow the released checkpoints (shared/reference/models.md §1 and §2).

Weights are slices of one pre-drawn normal buffer, so a 32 GB checkpoint takes memory copies rather than 16e9 draws.
Tensors are iid when the whole checkpoint fits in the buffer (the tiny sizes); larger ones reuse it at shifted offsets.

    python tools/make_checkpoint.py --arch llada2 --size tiny --dtype bf16 --out /tmp/x [--shards 2] [--seed 0]
"""

import argparse
import json
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "jaxllm" / "default_model"
DTYPES = {"bf16": (ml_dtypes.bfloat16, "bfloat16"), "f32": (np.float32, "float32")}
MATRIX_STD = 0.02
NORM_NOISE_STD = 0.1
EXPERT_BIAS_MAX = 0.1
POOL_ELEMENTS = 1 << 26  # 64M values: 256 MB of float32 draws
SHARD_BYTES = 9 << 29  # 4.5 GiB
MAX_WRITERS = 4  # shards generated and written at once; each holds one shard in memory


def _sdar_config(size: str) -> dict:
    shapes = {
        "tiny": {"vocab_size": 8192, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False},
        # SDAR-8B-Chat
        "full": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
    }[size]
    return {
        "architectures": ["SDARForCausalLM"], "model_type": "sdar", **shapes, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        # SDAR's released configs carry block_size and mask_token_id (the project tokenizer's mask here)
        "attention_bias": False, "block_size": 4, "mask_token_id": _special_token_ids()["<|mask|>"],
    }


def _llada2_config(size: str) -> dict:
    shapes = {
        "tiny": {"vocab_size": 8192, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "first_k_dense_replace": 1,
                 "num_experts": 16, "num_experts_per_tok": 4, "num_shared_experts": 1, "moe_intermediate_size": 32,
                 "n_group": 4, "topk_group": 2},
        # LLaDA2.0-mini
        "full": {"vocab_size": 157184, "hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
                 "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120, "first_k_dense_replace": 1,
                 "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1, "moe_intermediate_size": 512,
                 "n_group": 8, "topk_group": 4},
    }[size]
    return {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", **shapes, "hidden_act": "silu",
        "partial_rotary_factor": 0.5, "rope_theta": 600000.0, "rope_scaling": None, "use_qk_norm": True,
        "use_qkv_bias": False, "use_bias": False, "score_function": "sigmoid", "router_dtype": "fp32",
        "moe_router_enable_expert_bias": True, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 32768,
    }


def _sdar_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, head_dim, ffn = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{prefix}.self_attn.q_norm.weight": (head_dim,),
            f"{prefix}.self_attn.k_norm.weight": (head_dim,),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            **_swiglu_shapes(f"{prefix}.mlp", hidden, ffn),
        }
        if config["attention_bias"]:
            shapes |= {f"{prefix}.self_attn.{proj}.bias": (dim,)
                       for proj, dim in [("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim), ("o_proj", hidden)]}
    return shapes | _output_shapes(config)


def _llada2_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    qkv_dim = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    shapes = {"model.word_embeddings.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.attention.query_key_value.weight": (qkv_dim, hidden),  # rows: all q, all k, all v heads
            f"{prefix}.attention.dense.weight": (hidden, q_dim),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
        }
        if config["use_qkv_bias"]:
            shapes[f"{prefix}.attention.query_key_value.bias"] = (qkv_dim,)
        if config["use_bias"]:
            shapes[f"{prefix}.attention.dense.bias"] = (hidden,)
        if config["use_qk_norm"]:
            shapes[f"{prefix}.attention.query_layernorm.weight"] = (head_dim,)
            shapes[f"{prefix}.attention.key_layernorm.weight"] = (head_dim,)
        if layer < config["first_k_dense_replace"]:
            shapes |= _swiglu_shapes(f"{prefix}.mlp", hidden, config["intermediate_size"])
        else:
            shapes |= _moe_shapes(f"{prefix}.mlp", config)
    return shapes | _output_shapes(config)


def _moe_shapes(prefix: str, config: dict) -> dict[str, tuple[int, ...]]:
    hidden, num_experts, expert_ffn = config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]
    shapes = {f"{prefix}.gate.weight": (num_experts, hidden)}
    if config["moe_router_enable_expert_bias"]:
        shapes[f"{prefix}.gate.expert_bias"] = (num_experts,)
    for expert in range(num_experts):
        shapes |= _swiglu_shapes(f"{prefix}.experts.{expert}", hidden, expert_ffn)
    if config["num_shared_experts"]:
        shapes |= _swiglu_shapes(f"{prefix}.shared_experts", hidden, expert_ffn * config["num_shared_experts"])
    return shapes


def _swiglu_shapes(prefix: str, hidden: int, ffn: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (ffn, hidden),
        f"{prefix}.up_proj.weight": (ffn, hidden),
        f"{prefix}.down_proj.weight": (hidden, ffn),
    }


def _output_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    shapes = {"model.norm.weight": (config["hidden_size"],)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], config["hidden_size"])
    return shapes


ARCHS = {
    "sdar": (_sdar_config, _sdar_tensor_shapes),
    "llada2": (_llada2_config, _llada2_tensor_shapes),
}


class RandomWeights:
    """Fills tensors from slices of one normal buffer; a tensor's values depend only on the seed and its offset."""

    def __init__(self, seed: int, pool_elements: int, dtype: np.dtype):
        self.seed = seed
        self.dtype = dtype
        self.unit_normal = np.random.default_rng(seed).standard_normal(pool_elements, dtype=np.float32)
        self.matrix_pool = (self.unit_normal * MATRIX_STD).astype(dtype)

    def tensor(self, name: str, shape: tuple[int, ...], offset: int, index: int) -> np.ndarray:
        size = math.prod(shape)
        if name.endswith(".expert_bias"):
            # float32 as in the released checkpoints; positive so sigmoid scores + bias stay > 0.
            rng = np.random.default_rng([self.seed, index])
            return rng.uniform(0.0, EXPERT_BIAS_MAX, size=shape).astype(np.float32)
        if name.endswith("norm.weight"):
            noise = self._wrapped_slice(self.unit_normal, offset, size)
            return (1.0 + NORM_NOISE_STD * noise).astype(self.dtype).reshape(shape)
        return self._wrapped_slice(self.matrix_pool, offset, size).reshape(shape)

    @staticmethod
    def _wrapped_slice(pool: np.ndarray, offset: int, size: int) -> np.ndarray:
        out = np.empty(size, dtype=pool.dtype)
        filled, start = 0, offset % pool.size
        while filled < size:
            count = min(size - filled, pool.size - start)
            out[filled:filled + count] = pool[start:start + count]
            filled, start = filled + count, 0
        return out


def build_config(arch: str, size: str, dtype: str, **config_overrides) -> dict:
    """The config.json contents; token ids come from the project tokenizer, overrides replace existing fields."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    config = ARCHS[arch][0](size)
    unknown = sorted(set(config_overrides) - set(config))
    if unknown:
        raise ValueError(f"unknown {arch} config fields {unknown}; known: {sorted(config)}")
    eos_id = _special_token_ids()["<|endoftext|>"]
    token_ids = {"bos_token_id": eos_id} if arch == "sdar" else {}  # Qwen3 configs name bos = <|endoftext|>
    return {**config, **config_overrides, **token_ids, "eos_token_id": eos_id, "pad_token_id": eos_id,
            "torch_dtype": DTYPES[dtype][1]}


def _generation_config(config: dict) -> dict:
    special_ids = _special_token_ids()
    # Chat turns end at <|im_end|>; raw text at <|endoftext|>.
    stop_ids = [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]]
    generation = {"eos_token_id": stop_ids, "pad_token_id": config["pad_token_id"]}
    if "bos_token_id" in config:
        generation = {"bos_token_id": config["bos_token_id"], **generation}
    return generation


def _special_token_ids() -> dict[str, int]:
    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    return {token: tokenizer.token_to_id(token) for token in ("<|endoftext|>", "<|im_end|>", "<|mask|>")}


def plan_shards(tensor_bytes: dict[str, int], num_shards: int) -> list[list[str]]:
    """Contiguous groups of tensor names with about equal bytes, none of them empty."""
    names = list(tensor_bytes)
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be in [1, {len(names)}] for this checkpoint, got {num_shards}")
    shards, current, current_bytes = [], [], 0
    remaining_bytes = sum(tensor_bytes.values())
    for position, name in enumerate(names):
        current.append(name)
        current_bytes += tensor_bytes[name]
        shards_left = num_shards - len(shards)
        names_left = len(names) - position - 1
        if shards_left > 1 and (current_bytes >= remaining_bytes / shards_left or names_left == shards_left - 1):
            shards.append(current)
            remaining_bytes -= current_bytes
            current, current_bytes = [], 0
    shards.append(current)
    return shards


def _tensor_bytes(name: str, shape: tuple[int, ...], dtype: np.dtype) -> int:
    itemsize = 4 if name.endswith(".expert_bias") else np.dtype(dtype).itemsize
    return math.prod(shape) * itemsize


def _shard_filenames(num_shards: int) -> list[str]:
    if num_shards == 1:
        return ["model.safetensors"]
    return [f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors" for k in range(num_shards)]


def _remove_old_weights(out_dir: Path) -> None:
    for path in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        path.unlink(missing_ok=True)


def _write_weights(out_dir: Path, shapes: dict, dtype: np.dtype, seed: int, num_shards: int | None) -> None:
    tensor_bytes = {name: _tensor_bytes(name, shape, dtype) for name, shape in shapes.items()}
    total_bytes = sum(tensor_bytes.values())
    num_shards = num_shards or max(1, math.ceil(total_bytes / SHARD_BYTES))
    shards = plan_shards(tensor_bytes, num_shards)
    filenames = _shard_filenames(num_shards)

    # Offsets and indices are fixed up front so shards can be filled in any order with the same bytes.
    sizes = [math.prod(shape) for shape in shapes.values()]
    offsets = dict(zip(shapes, np.cumsum([0, *sizes[:-1]]).tolist()))
    indices = {name: index for index, name in enumerate(shapes)}
    weights = RandomWeights(seed, min(sum(sizes), POOL_ELEMENTS), dtype)

    progress = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="generating")

    def write_shard(names: list[str], filename: str) -> None:
        tensors = {}
        for name in names:
            tensors[name] = weights.tensor(name, shapes[name], offsets[name], indices[name])
            progress.update(tensor_bytes[name])
        save_file(tensors, out_dir / filename, metadata={"format": "pt"})
        progress.write(f"wrote {filename}")

    with ThreadPoolExecutor(max_workers=min(num_shards, MAX_WRITERS, os.cpu_count() or 1)) as pool:
        list(pool.map(write_shard, shards, filenames))
    progress.close()

    if num_shards > 1:
        weight_map = {name: filename for names, filename in zip(shards, filenames) for name in names}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        _write_json(out_dir / "model.safetensors.index.json", index)


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")


def make_checkpoint(out_dir, arch: str, size: str = "tiny", dtype: str = "f32", seed: int = 0,
                    num_shards: int | None = 1, with_weights: bool = True, **config_overrides) -> Path:
    """Write a random-weight HF checkpoint for `arch` ("sdar" or "llada2") and return its directory.

    Args:
        out_dir: directory to create or refresh; model*.safetensors already there are removed first.
        size: "tiny" (hidden 64, for tests) or "full" (SDAR-8B-Chat / LLaDA2.0-mini shapes).
        dtype: "bf16" or "f32" for every tensor except LLaDA2's float32 router expert_bias.
        seed: the same seed, arch, size, dtype and overrides give byte-identical files.
        num_shards: number of safetensors files; None picks ~4.5 GiB per shard.
        with_weights: False writes config and tokenizer only, for engines that make random weights on the device.
        config_overrides: replace config.json fields (e.g. num_hidden_layers=2); tensor shapes follow them.
    """
    config = build_config(arch, size, dtype, **config_overrides)
    shapes = ARCHS[arch][1](config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(out_dir)
    if with_weights:
        _write_weights(out_dir, shapes, DTYPES[dtype][0], seed, num_shards)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    for tokenizer_file in sorted(TOKENIZER_DIR.glob("tokenizer*.json")):
        shutil.copy(tokenizer_file, out_dir / tokenizer_file.name)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), required=True)
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shards", type=int, default=None, help="number of safetensors files (default: ~4.5 GiB each)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    start = time.perf_counter()
    out_dir = make_checkpoint(args.out, args.arch, args.size, args.dtype, args.seed, args.shards)
    total_gb = sum(path.stat().st_size for path in out_dir.glob("*.safetensors")) / 1e9
    print(f"wrote {args.arch} {args.size} ({total_gb:.2f} GB) to {out_dir} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
