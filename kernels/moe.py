"""Mixture-of-experts: routing and the expert SwiGLU layer.

Routing (float32, on device):
  route_grouped_sigmoid  LLaDA2 / DeepSeek-V3 style: s = sigmoid(logits); selection scores s + bias;
                         keep the `topk_group` groups whose top-2 selection scores sum highest; top-k
                         of the selection scores inside them; weights are the *unbiased* s of the
                         chosen experts, optionally normalised, times `routed_scaling_factor`.
  route_softmax_topk     softmax over experts, top-k, optionally renormalised.

Experts (axis letters: T tokens, C chosen experts per token, E experts, H hidden, I expert width):
  x               [T, H]
  expert_ids      i32[T, C]
  expert_weights  f32[T, C]
  w_gate_up       [E, H, 2I]   gate in [..., :I], up in [..., I:]
  w_down          [E, I, H]
  out[t] = sum_c w[t,c] * (silu(x[t] @ Wg[e]) * (x[t] @ Wu[e])) @ Wd[e],  e = expert_ids[t, c]
"""

import functools

import jax
import jax.numpy as jnp


def route_grouped_sigmoid(router_logits, expert_bias, *, top_k, n_group, topk_group, routed_scaling_factor,
                          norm_topk_prob):
    """f32[T, E] logits -> (f32[T, top_k] weights, i32[T, top_k] expert ids)."""
    num_tokens, num_experts = router_logits.shape
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
    choice = scores + expert_bias.astype(jnp.float32)[None, :]
    grouped = choice.reshape(num_tokens, n_group, num_experts // n_group)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # [T, n_group]
    _, kept_groups = jax.lax.top_k(group_scores, topk_group)
    group_kept = jnp.zeros((num_tokens, n_group), bool).at[jnp.arange(num_tokens)[:, None], kept_groups].set(True)
    choice = jnp.where(jnp.repeat(group_kept, num_experts // n_group, axis=1), choice, -jnp.inf)
    _, expert_ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, expert_ids, axis=1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, expert_ids.astype(jnp.int32)


def route_softmax_topk(router_logits, *, top_k, norm_topk_prob):
    """f32[T, E] logits -> (f32[T, top_k] weights, i32[T, top_k] expert ids)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, expert_ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, expert_ids.astype(jnp.int32)


def moe_experts_reference(x, expert_ids, expert_weights, w_gate_up, w_down):
    """Every expert on every token, combined with a dense [T, E] weight matrix (float32 math)."""
    num_tokens = x.shape[0]
    num_experts, _, two_i = w_gate_up.shape
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32)
    combine = combine.at[jnp.arange(num_tokens)[:, None], expert_ids].add(expert_weights.astype(jnp.float32))
    gate_up = jnp.einsum("th,ehn->ten", x.astype(jnp.float32), w_gate_up.astype(jnp.float32))
    act = jax.nn.silu(gate_up[..., : two_i // 2]) * gate_up[..., two_i // 2:]
    out = jnp.einsum("tei,eih,te->th", act, w_down.astype(jnp.float32), combine)
    return out.astype(x.dtype)


def _moe_experts_pallas(x, expert_ids, expert_weights, w_gate_up, w_down, *, interpret):
    raise NotImplementedError("the Pallas grouped GEMM lands with the MoE kernel issue")


def _default_impl():
    return "pallas" if jax.default_backend() == "gpu" else "reference"


@functools.partial(jax.named_call, name="moe_experts")
def moe_experts(x, expert_ids, expert_weights, w_gate_up, w_down, *, impl="auto", interpret=False):
    """Routed SwiGLU experts. Shapes in the module docstring; returns [T, H] in x's dtype."""
    impl = _default_impl() if impl == "auto" else impl
    if impl == "reference":
        return moe_experts_reference(x, expert_ids, expert_weights, w_gate_up, w_down)
    if impl == "pallas":
        return _moe_experts_pallas(x, expert_ids, expert_weights, w_gate_up, w_down, interpret=interpret)
    raise ValueError(f"unknown moe impl {impl!r}; use 'auto', 'pallas' or 'reference'")
