"""jaxllm models against their PyTorch stand-ins on the same tiny checkpoints.

Logits are compared through the paged path the engine uses: the leading blocks are prefilled into pages, then the
remaining tokens run as a window that reads those pages, so block boundaries, page reads and the in-window
block-causal mask are all exercised.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxllm.models import load_model, model_config
from jaxllm.models.layers import AttentionMetadata, KVCache
from tests.models import torch_reference

ARCHS = {"sdar": torch_reference.qwen3_from_sdar, "llada2": torch_reference.glm4moe_from_llada2}
BLOCK_SIZE = 4
PROMPT_LENGTHS = (5, 11, 16)  # a tail after one block, several blocks with a tail, whole blocks


@functools.partial(jax.jit, static_argnames="graphdef")
def _forward(graphdef, params, tokens, kv, md):
    model = nnx.merge(graphdef, params)
    hidden, kv = model(tokens, kv, md)
    return model.logits(hidden), kv


def jax_logits(model, cfg, token_ids: list[int], split: int, block_size: int, dtype) -> np.ndarray:
    """Logits of positions [split, T): tokens [0, split) are written to pages first (split % block_size == 0)."""
    num_pages = 8
    pool = (cfg.num_layers, cfg.num_kv_heads, num_pages, block_size, cfg.head_dim)
    kv = KVCache(jnp.zeros(pool, dtype), jnp.zeros(pool, dtype))
    page_table = jnp.asarray(np.random.default_rng(0).permutation(num_pages)[None], jnp.int32)  # scattered pages
    tokens = jnp.asarray([token_ids], jnp.int32)
    graphdef, params = nnx.split(model)
    if split:
        md = AttentionMetadata(page_table, jnp.array([0], jnp.int32), jnp.array([split], jnp.int32), block_size)
        _, kv = _forward(graphdef, params, tokens[:, :split], kv, md)
    window = len(token_ids) - split
    md = AttentionMetadata(page_table, jnp.array([split], jnp.int32), jnp.array([window], jnp.int32), block_size)
    logits, _ = _forward(graphdef, params, tokens[:, split:], kv, md)
    return np.asarray(logits)[0]


def relative_error(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def models(checkpoints):
    built = {}
    for arch, make_torch in ARCHS.items():
        path = checkpoints(arch)
        cfg = model_config(path)
        built[arch] = (cfg, load_model(path, cfg, "float32"), make_torch(path), path)
    return built


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_float32_logits_match_pytorch(models, arch, length):
    cfg, model, torch_model, _ = models[arch]
    token_ids = np.random.default_rng(length).integers(4, 8000, length).tolist()
    reference = torch_reference.logits(torch_model, token_ids, BLOCK_SIZE)
    for split in sorted({0, (length - 1) // BLOCK_SIZE * BLOCK_SIZE}):
        ours = jax_logits(model, cfg, token_ids, split, BLOCK_SIZE, jnp.float32)
        assert relative_error(ours, reference[split:]) <= 1e-4, f"split at {split}"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bfloat16_logits_stay_within_twice_the_pytorch_bfloat16_error(models, arch):
    """bf16 rounds at every matmul input (8 bits of mantissa), so exact agreement is not expected; what is expected
    is an error of the same size as PyTorch's own bf16 run against float32. The bound: at most 2x PyTorch's bf16
    error plus 1e-3, and an absolute ceiling of 5e-2 (two bf16 ulps of relative error, compounded over the layers)."""
    cfg, _, torch_model_f32, path = models[arch]
    model_bf16 = load_model(path, cfg, "bfloat16")
    torch_bf16 = ARCHS[arch](path, torch.bfloat16)
    token_ids = np.random.default_rng(7).integers(4, 8000, 11).tolist()
    reference = torch_reference.logits(torch_model_f32, token_ids, BLOCK_SIZE)
    torch_error = relative_error(torch_reference.logits(torch_bf16, token_ids, BLOCK_SIZE), reference)
    ours = jax_logits(model_bf16, cfg, token_ids, 8, BLOCK_SIZE, jnp.bfloat16)
    our_error = relative_error(ours, reference[8:])
    assert our_error <= min(2 * torch_error + 1e-3, 5e-2), (our_error, torch_error)


def test_llada2_routing_each_token_to_one_expert_matches_pytorch(checkpoints):
    """top_k = 1: the weight is the expert's raw score times routed_scaling_factor (nothing to normalise), as the
    reference gate and the stand-in give it."""
    path = checkpoints("llada2", num_experts_per_tok=1)
    cfg = model_config(path)
    token_ids = np.random.default_rng(5).integers(4, 8000, 11).tolist()
    ours = jax_logits(load_model(path, cfg, "float32"), cfg, token_ids, 8, BLOCK_SIZE, jnp.float32)
    reference = torch_reference.logits(torch_reference.glm4moe_from_llada2(path), token_ids, BLOCK_SIZE)
    assert relative_error(ours, reference[8:]) < 1e-4


def test_llada2_normalises_top_k_weights_whatever_norm_topk_prob_says(checkpoints, tmp_path):
    """The reference gate (dFactory `LLaDA2MoeGate`) normalises the top-k weights whenever top_k > 1 and never
    reads norm_topk_prob: a config with false must give the same logits as one with true."""
    path = checkpoints("llada2")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"norm_topk_prob": False}))
    token_ids = np.random.default_rng(3).integers(4, 8000, 8).tolist()
    logits = [jax_logits(load_model(p, model_config(p), "float32"), model_config(p), token_ids, 0, BLOCK_SIZE,
                         jnp.float32) for p in (path, tmp_path)]
    np.testing.assert_array_equal(logits[1], logits[0])
