"""The attention prologue (q/k RMSNorm and RoPE): the in-kernel `rotated_head_tile` against the XLA `qk_norm_rope`,
and the fused attention kernel in its place in the model.

The kernels run in interpret mode, where Pallas fills outputs with NaN first: an element a kernel never writes fails
the comparison (on the GPU the helper is compiled inside the attention kernel: test_paged_attention.py's from_qkv
tests). Every case draws fresh random inputs.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxllm.kernels import attention_prologue as ap

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # bf16: the kernel rounds once where XLA may round per op


@dataclasses.dataclass(frozen=True)
class Case:
    num_tokens: int
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rotary_dim: int = 64
    dtype: str = "float32"


CASES = {
    "llada2_partial_rope_bf16": Case(32, num_heads=16, num_kv_heads=4, head_dim=128, rotary_dim=64, dtype="bfloat16"),
    "sdar_full_rope": Case(32, num_heads=8, num_kv_heads=2, head_dim=128, rotary_dim=128),
    "quarter_rope": Case(16, rotary_dim=16),
    "rotary_half_not_a_power_of_2": Case(8, head_dim=64, rotary_dim=48, dtype="bfloat16"),
    "tiny_heads": Case(4, num_heads=2, num_kv_heads=1, head_dim=16, rotary_dim=8),
}


def _heads_kernel(qkv_ref, norm_ref, cos_ref, sin_ref, out_ref, *, first_head, rotary_half, eps):
    """Head first_head + program id of every token through rotated_head_tile: out [T, 1, D]. A grid over the heads
    (not a loop) traces the tile once: unrolled over LLaDA2's 20 heads it took ~8 s to compile in interpret mode."""
    tokens = jax.lax.iota(jnp.int32, qkv_ref.shape[0])
    head_start = (first_head + pl.program_id(0)) * norm_ref.shape[0]
    rotated = ap.rotated_head_tile(qkv_ref, tokens, jnp.full(tokens.shape, head_start, jnp.int32), norm_ref,
                                   cos_ref, sin_ref, rotary_half=rotary_half, eps=eps)
    out_ref[:, 0, :] = rotated.astype(out_ref.dtype)


def _rotated_heads(qkv, norm, cos, sin, *, first_head, num_heads, rotary_half, dtype):
    """[T, num_heads, D]: heads [first_head, first_head + num_heads) of qkv by `_heads_kernel`."""
    num_tokens, head_dim = qkv.shape[0], norm.shape[0]
    whole = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_heads_kernel, first_head=first_head, rotary_half=rotary_half, eps=1e-6)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), dtype),
                          grid=(num_heads,), in_specs=[whole] * 4,
                          out_specs=pl.BlockSpec((num_tokens, 1, head_dim), lambda head: (0, head, 0)),
                          interpret=True)(qkv, norm, cos, sin)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rotated_head_tile_matches_qk_norm_rope(name):
    case = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    dtype = jnp.dtype(case.dtype)
    width = (case.num_heads + 2 * case.num_kv_heads) * case.head_dim
    qkv = jnp.asarray(rng.normal(size=(case.num_tokens, width)), dtype)
    q_norm, k_norm = (jnp.asarray(1 + 0.3 * rng.normal(size=case.head_dim), dtype) for _ in range(2))
    positions = jnp.asarray(rng.integers(0, 4096, case.num_tokens), jnp.int32)
    cos, sin = ap.rope_tables(positions, theta=10000.0, rotary_dim=case.rotary_dim)
    q, k, _ = ap.qk_norm_rope(qkv, q_norm, k_norm, cos, sin, num_heads=case.num_heads,
                              num_kv_heads=case.num_kv_heads, eps=1e-6)
    rows = ap.rope_rows(cos, sin, case.head_dim, dtype)
    heads = functools.partial(_rotated_heads, qkv, cos=rows[0], sin=rows[1], rotary_half=case.rotary_dim // 2,
                              dtype=dtype)
    got = jnp.concatenate([heads(q_norm, first_head=0, num_heads=case.num_heads),
                           heads(k_norm, first_head=case.num_heads, num_heads=case.num_kv_heads)], axis=1)
    want = jnp.concatenate([q, k], axis=1)
    tolerance = TOLERANCE[case.dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tolerance,
                               atol=tolerance)


def test_engine_tokens_are_the_same_with_the_kernel_inside_the_model(checkpoints, monkeypatch):
    """The fused attention kernel in its place in the model (interpret mode here), through prefill and decode
    rounds: the same greedy tokens as the XLA path. Partial RoPE (LLaDA2), a batch of two, a prompt that ends inside
    a page."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.kernels.paged_attention import paged_attention_from_qkv
    from jaxllm.models import layers

    prompts = [list(range(5, 18)), list(range(40, 47))]

    def generate():
        llm = LLM(checkpoints("llada2", lm_head_scale=60), decoding_strategy="fixed_steps", denoising_steps=4,
                  dtype="float32", block_size=4, max_num_seqs=2, max_model_len=32, num_pages=64)
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]

    want = generate()
    calls = []

    def kernel_attention(*args, impl, **kwargs):
        calls.append(impl)
        return paged_attention_from_qkv(*args, impl="pallas", interpret=True, **kwargs)

    monkeypatch.setattr(layers, "paged_attention_from_qkv", kernel_attention)
    assert generate() == want and calls  # the patched path was traced
