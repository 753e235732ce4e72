"""Building blocks shared by the block-diffusion transformers: norms, RoPE, attention over the page pool, MLPs.

Axis letters: B batch, Q window tokens, E model width, H query heads, K kv heads, D head dim, V vocab.
Numerics follow the Hugging Face reference implementations: RMSNorm in float32 cast back before the weight,
RoPE tables in float32 cast to the activation dtype, softmax in float32, logits in float32.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxllm.kernels.attention_prologue import qk_norm_rope, rms_norm, rms_row_scale, rope_tables
from jaxllm.kernels.matmul import invariant_matmul
from jaxllm.kernels.paged_attention import paged_attention_from_qkv
from jaxllm.kernels.rms_norm import invariant_rms_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """The page pool of every layer; donated to each step and updated in place."""

    k_pages: jax.Array  # [L, K, P, S, D]
    v_pages: jax.Array  # [L, K, P, S, D]

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype) -> "KVCache":
        """A pool of `shape` [L, K, P, S, D], allocated before returning (an allocator's refusal raises here)."""
        return jax.block_until_ready(cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where a step's window sits: positions context_len + i, pages through page_table."""

    page_table: jax.Array  # i32[B, W]
    context_lens: jax.Array  # i32[B] committed tokens before the window (a multiple of block_size)
    window_lens: jax.Array  # i32[B] valid window tokens; later ones are placeholders
    block_size: int = dataclasses.field(metadata=dict(static=True))
    attention_impl: str = dataclasses.field(default="auto", metadata=dict(static=True))

    def positions(self, window: int) -> jax.Array:  # i32[B, Q]
        return self.context_lens[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseMetadata:
    """Training-time attention over the whole sequence with an explicit mask; no page pool is read or written."""

    positions: jax.Array  # i32[B, T] RoPE positions
    mask: jax.Array  # bool[B or 1, T, T] query i may see key j; every query must see at least one key
    # jax.nn.dot_product_attention's backend: None/"xla" (any device) or "cudnn" (GPU flash attention, bf16)
    attention_impl: str | None = dataclasses.field(default=None, metadata=dict(static=True))


def dense_attention(q, k, v, md: DenseMetadata):
    """Masked softmax attention, q [B, T, H, D], k/v [B, T, K, D]: matmuls in q's dtype with float32 accumulation,
    softmax in float32 (jax.nn.dot_product_attention's contract); float32 matmuls in full float32, as in `matmul`."""
    with jax.default_matmul_precision("highest" if q.dtype == jnp.float32 else None):
        return jax.nn.dot_product_attention(q, k, v, mask=md.mask[:, None], implementation=md.attention_impl)


def normal_init(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def matmul(x, w, preferred_element_type=None):
    """x @ w in x's dtype (or preferred_element_type). A float32 model multiplies in float32: XLA:GPU would otherwise
    round float32 operands to TF32 on the tensor cores (5e-4 relative logit error on the tiny models, H200), and
    PyTorch's float32 matmuls do not."""
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=preferred_element_type,
                   precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)


# measured at 32 rows (one request's 32-token block), where XLA splits every GEMM's K; two requests' 64 rows are
# assumed alike (not measured)
_ROW_SCALE_MAX_ROWS = 64


def rms_norm_matmul(x, norm_weight, eps, w):
    """rms_norm(x, norm_weight, eps) @ w, with the norm's row scale applied to the product instead of to x.

    The scale is one number per row, so it commutes with the GEMM: the GEMM reads norm_weight * x (XLA fuses the
    product into the GEMM) and the scale rides the kernel that sums XLA's split-K partials, so a row reduction (1.56 us
    at 32 rows, run 24's profile) replaces the normalisation kernel (1.75 in run 23's). Rounding differs from
    `rms_norm`'s by about one unit in the last place of x's dtype. At many rows the GEMM is not split and the scale
    may need a pass of its own (not profiled), so Linear uses this only up to _ROW_SCALE_MAX_ROWS rows.
    H200, engine run 24 (ABAB, one call): SDAR-8B batch 1 (32 rows) 4.894 / 4.927 ms per forward against 4.969 /
    4.976 without it; LLaDA2 batch 1 5.857 against 5.848 (level); LLaDA2 batch 32 (1024 rows) 11.998 against 11.863
    (+135 us, inside the runs' 0.17-0.23 ms spread, and not applied there).
    """
    product = matmul(norm_weight.astype(x.dtype) * x, w, preferred_element_type=jnp.float32)
    return (product * rms_row_scale(x.astype(jnp.float32), eps)).astype(x.dtype)


def router_matmul(x, pieces, batch_invariant=False):
    """x @ w to float32 accuracy, f32[..., N], from w's pieces bf16 [K, 3N] (`cut_router_weight`).

    bf16 x (LLaDA2's router reads the bf16 hidden states): one bf16 GEMM by the pieces with float32 accumulation;
    each product is exact, and the error is float32 rounding in the additions (about twice IEEE float32's against a
    float64 product in the tests: three partial sums round separately). Every row count multiplies by the pieces;
    XLA may still pick a different GEMM (and order of additions) per row count, so batch 1 and larger batches give a
    token the same logits up to float32 rounding. float32 x (float32 models): w = hi + mid + lo (exact) and an
    IEEE float32 product, as `matmul`. batch_invariant: `invariant_matmul` multiplies instead of XLA's GEMM.
    The pieces are cut when the weights load, not in each forward. H200, the router alone (runs/s19/router_probe.py,
    2026-12-01, us per layer, 19 layers; float32 / cut in each call / cut beforehand): 32 rows 7.20 / 7.19 / 7.79,
    256 rows 16.75 / 13.02 / 9.81, 1024 rows 40.84 / 19.49 / 15.18: 3-4 us per MoE layer saved at batch 8 and 32,
    0.6 us lost at batch 1. Pieces stacked along K ([3K, N], x repeated) were slower (22.1 / 25.9 us at 1024 rows),
    and XLA's BF16_BF16_F32_X6 algorithm slower above 32 rows, no faster at batch 1 (engine run 18).
    """
    if x.dtype == jnp.float32:
        hi, mid, lo = (p.astype(jnp.float32) for p in jnp.split(pieces, 3, axis=-1))
        return invariant_matmul(x, hi + (mid + lo)) if batch_invariant else matmul(x, hi + (mid + lo))
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"router_matmul takes bf16 or float32 x, got {x.dtype}")
    if batch_invariant:
        out = invariant_matmul(x, pieces, out_dtype=jnp.float32)
    else:
        out = jnp.dot(x, pieces, preferred_element_type=jnp.float32)
    hi, mid, lo = jnp.split(out, 3, axis=-1)
    return hi + (mid + lo)  # the two small sums first: one rounding fewer at hi's scale


class Linear(nnx.Module):
    """y = x @ kernel, kernel [in, out] (HF stores [out, in]; the loader transposes).

    batch_invariant (every module that multiplies has it; the engine sets it with `set_attributes`): each row's
    bits independent of the rows beside it (`invariant_matmul`, no row-scale shortcut at few rows).
    """

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.kernel = normal_init(rngs, (in_features, out_features), dtype)
        self.batch_invariant = False

    def __call__(self, x, norm: "RMSNorm | None" = None):
        """x @ kernel, or norm(x) @ kernel (`rms_norm_matmul` at few rows)."""
        if norm is not None and not self.batch_invariant and x.size // x.shape[-1] <= _ROW_SCALE_MAX_ROWS:
            return rms_norm_matmul(x, norm.weight[...], norm.eps, self.kernel[...])
        product = invariant_matmul if self.batch_invariant else matmul
        return product(x if norm is None else norm(x), self.kernel[...])


class RMSNorm(nnx.Module):
    """batch_invariant: `invariant_rms_norm`, each row normalised alike at any row count (XLA's fused norm is not)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps
        self.batch_invariant = False

    def __call__(self, x):
        return (invariant_rms_norm if self.batch_invariant else rms_norm)(x, self.weight[...], self.eps)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up are one [E, 2I] projection (one GEMM), gate first."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs):
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, norm: RMSNorm | None = None):  # norm(x) when a norm is given
        gate, up = jnp.split(self.gate_up_proj(x, norm), 2, axis=-1)
        return self.down_proj(jax.nn.silu(gate) * up)


class Attention(nnx.Module):
    """GQA with per-head QK RMSNorm and (partial) RoPE over the paged KV pool.

    One [E, (H+2K)*D] projection makes q, k and v (one GEMM): LLaDA2 stores it so (`query_key_value`); the loader
    concatenates Qwen3's q/k/v projections into it.
    """

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_theta, self.rotary_dim, self.rms_norm_eps = cfg.rope_theta, cfg.rotary_dim, cfg.rms_norm_eps
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_width + 2 * kv_width, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.o_proj = Linear(q_width, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.batch_invariant = False  # the attention kernel's tiles the same at any batch (see Linear)

    def __call__(self, x, kv: KVCache | None, layer, md: AttentionMetadata | DenseMetadata,
                 norm: RMSNorm | None = None):  # attends over norm(x) when a norm is given
        batch, window, _ = x.shape
        qkv = self.qkv_proj(x, norm)
        positions = md.positions if isinstance(md, DenseMetadata) else md.positions(window)
        cos, sin = rope_tables(positions, theta=self.rope_theta, rotary_dim=self.rotary_dim)
        norm_weights = (self.q_norm.weight[...], self.k_norm.weight[...])
        if isinstance(md, DenseMetadata):
            q, k, v = qk_norm_rope(qkv, *norm_weights, cos, sin, num_heads=self.num_heads,
                                   num_kv_heads=self.num_kv_heads, eps=self.rms_norm_eps)
            return self.o_proj(dense_attention(q, k, v, md).reshape(batch, window, -1)), kv
        # q/k norms, RoPE and the window's K/V written into the pool happen inside the attention kernel
        out, k_pages, v_pages = paged_attention_from_qkv(
            qkv, *norm_weights, cos, sin, kv.k_pages, kv.v_pages, layer, md.page_table, md.context_lens,
            md.window_lens, num_heads=self.num_heads, eps=self.rms_norm_eps, block_size=md.block_size,
            impl=md.attention_impl, batch_invariant=self.batch_invariant)
        return self.o_proj(out.reshape(batch, window, -1)), KVCache(k_pages, v_pages)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h)); each norm goes to the module it feeds,
    whose projection applies it (`rms_norm_matmul`)."""

    def __init__(self, cfg, mlp: nnx.Module, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = mlp

    def __call__(self, x, kv: KVCache, layer, md: AttentionMetadata):
        attn_out, kv = self.attn(x, kv, layer, md, self.input_layernorm)
        x = x + attn_out
        return x + self.mlp(x, self.post_attention_layernorm), kv


def run_layers(layers: nnx.List, x, kv: KVCache | None, md: AttentionMetadata | DenseMetadata):
    """The decoder layers in order over (x, kv); layer i reads and writes pool slice i.

    Layers are unrolled, each with its own weight buffers: scanning over weights stacked on a layer axis makes
    XLA copy every layer's slice out of the stack before its matmuls, tripling the bytes a forward moves.
    """
    for index, layer in enumerate(layers):
        x, kv = layer(x, kv, jnp.int32(index), md)
    return x, kv


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = normal_init(rngs, (vocab_size, hidden_size), dtype)
        self.batch_invariant = False  # the tied LM head (see Linear)

    def __call__(self, tokens):
        return jnp.take(self.embedding[...], tokens, axis=0)

    def attend(self, x):  # tied LM head; in batch_invariant mode through a transposed copy of the table per call
        return (invariant_matmul if self.batch_invariant else matmul)(x, self.embedding[...].T)


class DecoderLM(nnx.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding, or its own).

    Models differ in the MLP of each layer (make_mlp(layer_index)).
    """

    def __init__(self, cfg, make_mlp, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, make_mlp(i), dtype=dtype, rngs=rngs)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    def __call__(self, tokens, kv: KVCache | None, md: AttentionMetadata | DenseMetadata):
        """tokens i32[B, Q] -> final hidden states [B, Q, E], updated pool."""
        x, kv = run_layers(self.layers, self.embed(tokens), kv, md)
        return self.norm(x), kv

    def head(self, hidden):  # [..., V] in the model's dtype, as the reference's LM head returns them
        return self.embed.attend(hidden) if self.cfg.tie_word_embeddings else self.lm_head(hidden)

    def logits(self, hidden):  # f32[..., V]
        return self.head(hidden).astype(jnp.float32)
