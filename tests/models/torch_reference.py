"""PyTorch stand-ins for the jaxllm models, built from the same checkpoint files (models.md §1.5, §2).

SDAR is Qwen3ForCausalLM verbatim. LLaDA2 is Glm4MoeForCausalLM with the fused QKV split by heads, attention and
router names renamed and the per-expert weights stacked. Both run with an explicit 4D block-causal mask.
"""

import json
import pathlib

import numpy as np
import torch
from safetensors.numpy import load_file

from tools.torch_stand_ins import stand_in


def _tensors(model_dir: pathlib.Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors |= load_file(file)
    return {k: v.astype(np.float32) for k, v in tensors.items()}


def _load(model, state: dict[str, np.ndarray], dtype):
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in k for k in missing), missing
    return model.to(dtype).eval()


def qwen3_from_sdar(model_dir: pathlib.Path, dtype=torch.float32):
    model_class, config = stand_in(json.loads((model_dir / "config.json").read_text()))
    return _load(model_class(config), _tensors(model_dir), dtype)


def glm4moe_from_llada2(model_dir: pathlib.Path, dtype=torch.float32):
    hf = json.loads((model_dir / "config.json").read_text())
    model_class, config = stand_in(hf)
    return _load(model_class(config), _glm4moe_state(_tensors(model_dir), hf), dtype)


def _glm4moe_state(src: dict[str, np.ndarray], hf: dict) -> dict[str, np.ndarray]:
    q_rows = hf["num_attention_heads"] * hf["head_dim"]
    kv_rows = hf["num_key_value_heads"] * hf["head_dim"]
    out = {"model.embed_tokens.weight": src["model.word_embeddings.weight"],
           "model.norm.weight": src["model.norm.weight"], "lm_head.weight": src["lm_head.weight"]}
    for layer in range(hf["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        qkv = src[p + "attention.query_key_value.weight"]
        out |= {p + "self_attn.q_proj.weight": qkv[:q_rows],
                p + "self_attn.k_proj.weight": qkv[q_rows:q_rows + kv_rows],
                p + "self_attn.v_proj.weight": qkv[q_rows + kv_rows:],
                p + "self_attn.o_proj.weight": src[p + "attention.dense.weight"],
                p + "self_attn.q_norm.weight": src[p + "attention.query_layernorm.weight"],
                p + "self_attn.k_norm.weight": src[p + "attention.key_layernorm.weight"]}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = src[p + norm + ".weight"]
        if layer < hf["first_k_dense_replace"]:
            for name in ("gate_proj", "up_proj", "down_proj"):
                out[p + f"mlp.{name}.weight"] = src[p + f"mlp.{name}.weight"]
            continue
        experts = range(hf["num_experts"])
        out[p + "mlp.gate.weight"] = src[p + "mlp.gate.weight"]
        out[p + "mlp.gate.e_score_correction_bias"] = src[p + "mlp.gate.expert_bias"]
        out[p + "mlp.experts.gate_up_proj"] = np.stack([
            np.concatenate([src[p + f"mlp.experts.{e}.gate_proj.weight"], src[p + f"mlp.experts.{e}.up_proj.weight"]])
            for e in experts])
        out[p + "mlp.experts.down_proj"] = np.stack([src[p + f"mlp.experts.{e}.down_proj.weight"] for e in experts])
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[p + f"mlp.shared_experts.{name}.weight"] = src[p + f"mlp.shared_experts.{name}.weight"]
    return out


def block_causal_mask(length: int, block_size: int) -> torch.Tensor:
    """bool [1, 1, T, T]: position i sees j iff j // B <= i // B."""
    blocks = torch.arange(length) // block_size
    return (blocks[None, :] <= blocks[:, None])[None, None]


@torch.no_grad()
def logits(model, token_ids: list[int], block_size: int) -> np.ndarray:
    """f32[T, V] logits of the whole sequence under the block-causal mask."""
    ids = torch.tensor([token_ids])
    out = model(ids, attention_mask=block_causal_mask(len(token_ids), block_size),
                position_ids=torch.arange(len(token_ids))[None])
    return out.logits[0].float().numpy()
