"""The transformers classes that stand in for jaxllm's models (models.md §1.5, §2), configured from a config.json.

SDAR is Qwen3ForCausalLM verbatim; LLaDA2 is Glm4MoeForCausalLM with renamed MoE fields. Used by the PyTorch parity
tests and by tools/bench_torch_forward.py.
"""

import contextlib
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _repository_off_sys_path():
    """transformers >= 5.25 imports Hugging Face's `kernels` package with its models. Where this repository's root is
    on sys.path (pytest's `pythonpath`, `python -m tools...` from the root), its own kernels/ directory is found first
    and that import fails; the root leaves sys.path while transformers imports the models."""
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if Path(entry or ".").resolve() != REPOSITORY]
    try:
        yield
    finally:
        sys.path[:] = saved


with _repository_off_sys_path():
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM


def stand_in(hf: dict):
    """(model class, its config) for an SDAR or LLaDA2 config.json dict."""
    common = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"], rms_norm_eps=hf["rms_norm_eps"],
        max_position_embeddings=hf["max_position_embeddings"], tie_word_embeddings=hf["tie_word_embeddings"],
        attn_implementation="sdpa")
    if hf["model_type"] == "sdar":
        return Qwen3ForCausalLM, Qwen3Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": hf["rope_theta"]})
    return Glm4MoeForCausalLM, Glm4MoeConfig(
        **common, rope_parameters={"rope_type": "default", "rope_theta": hf["rope_theta"],
                                   "partial_rotary_factor": hf["partial_rotary_factor"]},
        moe_intermediate_size=hf["moe_intermediate_size"], num_experts_per_tok=hf["num_experts_per_tok"],
        n_shared_experts=hf["num_shared_experts"], n_routed_experts=hf["num_experts"],
        routed_scaling_factor=hf["routed_scaling_factor"], n_group=hf["n_group"], topk_group=hf["topk_group"],
        first_k_dense_replace=hf["first_k_dense_replace"], use_qk_norm=True, attention_bias=False,
        # as LLaDA2's gate: the top-k weights are normalised whenever top_k > 1, whatever norm_topk_prob says
        norm_topk_prob=hf["num_experts_per_tok"] > 1)
