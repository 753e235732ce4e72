"""The attention prologue kernel (q/k norm, RoPE, K/V page writes) against its pure-jnp reference.

On CPU the kernel runs in interpret mode, where Pallas fills the q/k/v outputs with NaN first: an element the
kernel never writes fails the comparison. The pool starts random and must come back equal to the reference's
everywhere, so a write to a wrong row, layer or head (or one that should have been dropped) fails too. Every case
draws fresh random inputs; pool rows of dropped tokens are past the pool's end or negative.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import attention_prologue as ap
from jaxllm.kernels.paged_attention import window_pool_rows

INTERPRET = jax.default_backend() != "gpu"
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # bf16: the kernel rounds once where XLA may round per op


@dataclasses.dataclass(frozen=True)
class Case:
    num_tokens: int
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rotary_dim: int = 64
    dtype: str = "float32"
    num_dropped: int = 0  # tokens whose K/V write is dropped (pool row past the end, or negative)


CASES = {
    "llada2_partial_rope_bf16": Case(32, num_heads=16, num_kv_heads=4, head_dim=128, rotary_dim=64, dtype="bfloat16"),
    "sdar_full_rope": Case(32, num_heads=8, num_kv_heads=2, head_dim=128, rotary_dim=128),
    "four_token_programs_with_drops": Case(12, num_dropped=5),
    "odd_token_count_with_drops": Case(7, num_dropped=3),  # one token per program
    "tiny_heads": Case(4, num_heads=2, num_kv_heads=1, head_dim=16, rotary_dim=8),
    "prefill_chunk_bf16": Case(80, rotary_dim=32, dtype="bfloat16", num_dropped=16),
}


def make_inputs(case, seed, num_layers=3, page_size=8):
    num_pages = case.num_tokens // page_size + 3
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    width = (case.num_heads + 2 * case.num_kv_heads) * case.head_dim
    qkv = jnp.asarray(rng.normal(size=(case.num_tokens, width)), dtype)
    q_weight, k_weight = (jnp.asarray(1 + 0.3 * rng.normal(size=case.head_dim), dtype) for _ in range(2))
    positions = jnp.asarray(rng.integers(0, 4096, case.num_tokens), jnp.int32)
    cos, sin = ap.rope_tables(positions, theta=10000.0, rotary_dim=case.rotary_dim)
    pool_shape = (num_layers, case.num_kv_heads, num_pages, page_size, case.head_dim)
    k_pages, v_pages = (jnp.asarray(rng.normal(size=pool_shape), dtype) for _ in range(2))
    rows = rng.permutation(num_pages * page_size)[:case.num_tokens]  # distinct rows: no two tokens race
    dropped = rng.permutation(case.num_tokens)[:case.num_dropped]
    rows[dropped[::2]] = num_pages * page_size + 7
    rows[dropped[1::2]] = -3
    return qkv, q_weight, k_weight, cos, sin, k_pages, v_pages, jnp.int32(1), jnp.asarray(rows, jnp.int32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pallas_matches_reference(name):
    case = CASES[name]
    args = make_inputs(case, seed=sorted(CASES).index(name))
    heads = dict(num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, eps=1e-6)
    expected = ap.attention_prologue_reference(*args, **heads)
    got = ap.attention_prologue(*args, impl="pallas", interpret=INTERPRET, **heads)
    tolerance = TOLERANCE[case.dtype]
    for name_out, want, have in zip(("q", "k", "v", "k_pages", "v_pages"), expected, got):
        assert have.shape == want.shape and have.dtype == want.dtype, name_out
        if name_out.startswith("v"):  # v passes through unchanged: every bit, and every pool row it must not touch
            np.testing.assert_array_equal(np.asarray(have), np.asarray(want), err_msg=name_out)
        np.testing.assert_allclose(np.asarray(have, np.float32), np.asarray(want, np.float32), rtol=tolerance,
                                   atol=tolerance, err_msg=name_out)


def test_every_pool_write_is_masked():
    """A dropped token's pool row points past the pool's end, where interpret mode drops the write anyway; on the GPU
    only the store's mask stops it (the flattened [L, K, P*S, D] view would take it as row 0 of the next kv head or
    layer). So the kernel's pool stores, and only those, must carry a mask."""
    case = Case(12, num_dropped=5)
    kernel_eqns = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            kernel_eqns.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    prologue = lambda *a: ap.attention_prologue(*a, num_heads=4, num_kv_heads=2, eps=1e-6, impl="pallas")  # noqa: E731
    walk(jax.make_jaxpr(prologue)(*make_inputs(case, seed=1)).jaxpr)
    stores = [eqn for eqn in kernel_eqns if "swap" in eqn.primitive.name]
    pool_stores = [eqn for eqn in stores if eqn.invars[0].aval.ndim == 4]  # the [L, K, P*S, D] pool views
    masked = [eqn for eqn in stores if "args_tree" in eqn.params and eqn.params["args_tree"].unflatten(eqn.invars)[3]
              is not None]
    assert len(pool_stores) == 4 and masked == pool_stores  # k and v pools x two head pieces


def test_reference_writes_each_valid_token_and_no_other_row():
    case = Case(6, num_dropped=2)
    qkv, qw, kw, cos, sin, k_pages, v_pages, layer, rows = make_inputs(case, seed=7)
    q, k, v, new_k_pages, new_v_pages = ap.attention_prologue_reference(
        qkv, qw, kw, cos, sin, k_pages, v_pages, layer, rows, num_heads=4, num_kv_heads=2, eps=1e-6)
    flat = np.asarray(new_v_pages).reshape(3, 2, -1, 64)  # pages flattened to rows
    old = np.asarray(v_pages).reshape(3, 2, -1, 64).copy()
    for token, row in enumerate(np.asarray(rows)):
        if 0 <= row < flat.shape[2]:
            np.testing.assert_array_equal(flat[1, :, row], np.asarray(v[token]))
            old[1, :, row] = flat[1, :, row]
    np.testing.assert_array_equal(flat, old)  # nothing else moved
    np.testing.assert_array_equal(np.asarray(v), np.asarray(qkv).reshape(6, 8, 64)[:, 6:])
    token = int(np.argmax((np.asarray(rows) >= 0) & (np.asarray(rows) < flat.shape[2])))
    np.testing.assert_array_equal(np.asarray(new_k_pages).reshape(3, 2, -1, 64)[1, :, int(rows[token])],
                                  np.asarray(k[token]))


def test_window_pool_rows_follow_the_page_table_and_drop_placeholders():
    page_table = jnp.asarray([[5, 2, 9], [1, 0, 0]], jnp.int32)
    rows = window_pool_rows(page_table, jnp.asarray([4, 0], jnp.int32), jnp.asarray([4, 2], jnp.int32),
                            window=4, page_size=4)
    dropped = np.iinfo(np.int32).max
    assert np.asarray(rows).tolist() == [2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 4, 5, dropped, dropped]


@pytest.mark.skipif(not INTERPRET, reason="the GPU compiles the kernel for real")
def test_kernel_lowers_to_triton_for_cuda():
    """Pallas -> Triton IR on CPU at LLaDA2.0-mini's shapes: catches what interpret mode does not check."""
    spec = jax.ShapeDtypeStruct
    tokens, heads, kv_heads, head_dim = 32, 16, 4, 128
    pool = spec((20, kv_heads, 64, 32, head_dim), jnp.bfloat16)
    args = (spec((tokens, (heads + 2 * kv_heads) * head_dim), jnp.bfloat16), spec((head_dim,), jnp.bfloat16),
            spec((head_dim,), jnp.bfloat16), spec((tokens, 32), jnp.float32), spec((tokens, 32), jnp.float32),
            pool, pool, spec((), jnp.int32), spec((tokens,), jnp.int32))
    prologue = jax.jit(lambda *a: ap.attention_prologue(*a, num_heads=heads, num_kv_heads=kv_heads, eps=1e-6,
                                                        impl="pallas"), donate_argnums=(5, 6))
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=h100)):
        hlo = prologue.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs a GPU")
def test_prologue_updates_a_donated_pool_in_place():
    """One 32-token window written into a donated 2 x 4 GiB pool must cost far less than copying the pool."""
    from tools.bench_attention import median_seconds

    shape = (8, 8, 16384, 16, 128)
    keys = jax.random.split(jax.random.key(0), 3)
    pools = tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys[:2])
    qkv = jax.random.normal(keys[2], (32, (32 + 16) * 128), jnp.bfloat16)
    cos, sin = ap.rope_tables(jnp.arange(32), theta=1e6, rotary_dim=128)
    rows = jnp.arange(32, dtype=jnp.int32) + 7 * 16
    weight = jnp.ones((128,), jnp.bfloat16)
    prologue = jax.jit(lambda k_pages, v_pages: ap.attention_prologue(
        qkv, weight, weight, cos, sin, k_pages, v_pages, jnp.int32(3), rows, num_heads=32, num_kv_heads=8,
        eps=1e-6, impl="pallas"), donate_argnums=(0, 1))

    def once():
        nonlocal pools
        *_, k_pages, v_pages = prologue(*pools)
        pools = (k_pages, v_pages)
        return pools

    once()
    seconds = median_seconds(once, min_reps=20, max_reps=20)
    copy = jax.jit(lambda a, b: (a + 1, b + 1))
    copy_seconds = median_seconds(lambda: copy(*pools), min_reps=5, max_reps=5)
    assert seconds < 0.25 * copy_seconds, (seconds, copy_seconds)
    np.testing.assert_array_equal(np.asarray(pools[1][3, :, 7]).transpose(1, 0, 2),
                                  np.asarray(qkv[:16]).reshape(16, 48, 128)[:, 40:])


def test_engine_tokens_are_the_same_with_the_kernel_inside_the_model(checkpoints, monkeypatch):
    """The kernel in its place in the model (interpret mode here), through prefill and decode rounds: the same greedy
    tokens as the XLA path. Partial RoPE (LLaDA2), a batch of two, a prompt that ends inside a page."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.models import layers

    prompts = [list(range(5, 18)), list(range(40, 47))]

    def generate():
        llm = LLM(checkpoints("llada2", lm_head_scale=60), decoding_strategy="fixed_steps", denoising_steps=4,
                  dtype="float32", block_size=4, max_num_seqs=2, max_model_len=64)
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]

    want = generate()
    calls = []

    def kernel_prologue(*args, impl, **kwargs):
        calls.append(impl)
        return ap.attention_prologue(*args, impl="pallas", interpret=True, **kwargs)

    monkeypatch.setattr(layers, "attention_prologue", kernel_prologue)
    assert generate() == want and calls  # the patched path was traced
