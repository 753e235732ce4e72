"""Load-time int8 / fp8 quantization of the routed experts: its cost in logits, and the engine option end to end."""

import jax.numpy as jnp
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError
from tools.quantization_error import quantization_errors

OPTIONS = dict(dtype="float32", block_size=4, max_num_seqs=4, max_model_len=64, num_pages=32)
PROMPTS = [[5, 6, 7], list(range(100, 111)), [42] * 6]


def test_quantized_experts_cost_a_small_logit_error(checkpoints):
    """In float32, so the error is the quantization's alone: an int8 step is 1/254 of a channel's range, an e4m3 step
    2^-3 of the value, so fp8 costs more; neither may be zero (the option silently ignored) or large (bad scales)."""
    errors = quantization_errors(checkpoints("llada2"), dtype="float32", num_prompts=2, length=32)
    int8, fp8 = (errors[f"float32 + {mode} experts"]["relative_error"] for mode in ("int8", "fp8"))
    assert errors["float32"]["relative_error"] == 0.0
    assert 1e-4 < int8 < 5e-3, errors
    assert int8 < fp8 < 2e-2, errors


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def confident_llada2(checkpoints):
    """A tiny LLaDA2 whose top tokens lead by wide margins, and its unquantized greedy tokens."""
    checkpoint = checkpoints("llada2", lm_head_scale=60)
    return checkpoint, [o.token_ids for o in LLM(checkpoint, **OPTIONS).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("mode, dtype", [("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)])
def test_engine_with_quantized_experts_keeps_greedy_tokens(confident_llada2, mode, dtype):
    """The greedy tokens survive quantization, and the engine really holds 1-byte experts."""
    checkpoint, reference = confident_llada2
    quantized = LLM(checkpoint, quantization=mode, **OPTIONS)
    assert sum(w.dtype == dtype for w in quantized.engine.runner.weights) == 4  # 2 MoE layers x gate_up, down
    assert [o.token_ids for o in quantized.generate(PROMPTS, GREEDY)] == reference


def test_quantizing_a_dense_model_is_a_config_error(checkpoints):
    with pytest.raises(ConfigError, match="MoE"):
        LLM(checkpoints("sdar"), quantization="int8", **OPTIONS)
