"""Load-time int8 / fp8 quantization of the routed experts: its cost in logits, and the engine option end to end."""

import gc

import jax
import jax.numpy as jnp
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError
from jaxllm.quantization import QuantizedWeight, dequantize
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


@pytest.mark.parametrize("mode, dtype", [("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)])
def test_engine_with_quantized_experts_runs_the_dequantized_model(checkpoints, mode, dtype):
    """`quantization=` changes how the experts are stored and nothing else: the engine holds 1-byte experts, and its
    greedy tokens are those of the same engine given the dequantized experts as plain weights. (Equal tokens to the
    unquantized model are not a property of quantization: where two positions' confidences nearly tie, any change
    of the weights can change which is committed first; the cost itself is bounded by the logit-error test.)"""
    checkpoint = checkpoints("llada2", lm_head_scale=60)  # confident: the tokens hinge on no float-level near-tie
    options = OPTIONS | dict(max_num_seqs=2)  # batches 1 and 2 only: each engine compiles its own steps
    quantized = LLM(checkpoint, quantization=mode, **options)
    assert sum(w.dtype == dtype for w in quantized.engine.runner.weights) == 4  # 2 MoE layers x gate_up, down
    dequantized = LLM(checkpoint, **options)
    plain = jax.tree.map(dequantize, quantized.engine.runner.params, is_leaf=lambda w: isinstance(w, QuantizedWeight))
    assert jax.tree.structure(plain) == jax.tree.structure(dequantized.engine.runner.params)
    dequantized.engine.runner.weights = jax.tree.leaves(plain)
    tokens = [o.token_ids for o in quantized.generate(PROMPTS, GREEDY)]
    assert tokens == [o.token_ids for o in dequantized.generate(PROMPTS, GREEDY)]


def test_experts_are_quantized_as_they_load(checkpoints, monkeypatch):
    """So a model whose experts fit the device only when quantized loads: at no point does the device hold two
    expert tensors at the checkpoint's width."""
    from jaxllm import loader
    from jaxllm.models import llada2

    def unquantized_alive():  # 3-d float32 arrays: expert stacks at the checkpoint's width (this test's dtype)
        return sum(a.ndim == 3 and a.dtype == jnp.float32 for a in jax.live_arrays())

    def watched(cfg, mode, path, value):  # just after a tensor's transfer
        counts.append(unquantized_alive() - before)
        return quantize_on_load(cfg, mode, path, value)

    def assembling(*args, **kwargs):  # just before the next transfer
        counts_between.append(unquantized_alive() - before)
        return assemble(*args, **kwargs)

    gc.collect()  # earlier tests' engines
    before, counts, counts_between = unquantized_alive(), [], []
    quantize_on_load, assemble = llada2.quantized, loader._assemble
    monkeypatch.setattr(llada2, "quantized", watched)
    monkeypatch.setattr(loader, "_assemble", assembling)
    LLM(checkpoints("llada2"), quantization="int8", **OPTIONS)
    assert max(counts) == 1 and max(counts_between) == 0


def test_quantizing_a_dense_model_is_a_config_error(checkpoints):
    with pytest.raises(ConfigError, match="MoE"):
        LLM(checkpoints("sdar"), quantization="int8", **OPTIONS)
