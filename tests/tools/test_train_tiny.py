"""tools/train_tiny.py on CPU: a tiny run learns, its checkpoint round-trips through jaxllm, and evaluation files
never reach training."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.models import load_model, model_config
from jaxllm.models.layers import DenseMetadata
from tools import train_tiny

SEQ_LEN, BLOCK = 32, 8
TINY_RUN = ["--preset", "test", "--steps", "20", "--batch", "8", "--seq-len", str(SEQ_LEN), "--block-size",
            str(BLOCK), "--max-files", "24", "--holdout-percent", "25", "--eval-interval", "10",
            "--warmup-steps", "5", "--lr", "1e-2", "--eval-windows", "8", "--timing-from", "5", "--timing-steps", "5",
            "--compute-dtype", "f32", "--quiet"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_tiny")
    return train_tiny.train(train_tiny.parse_args([*TINY_RUN, "--out", str(out)])), out


def two_stream_logits(model, tokens):
    """f32[1, 2T, V] logits of `model` on [tokens ; tokens] under the training attention mask."""
    graphdef, state = nnx.split(model)
    return np.asarray(_two_stream_logits(graphdef, state, tokens))


@functools.partial(jax.jit, static_argnums=0)
def _two_stream_logits(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    metadata = DenseMetadata(positions=jnp.tile(jnp.arange(SEQ_LEN, dtype=jnp.int32), 2)[None],
                             mask=jnp.asarray(train_tiny.two_stream_mask(SEQ_LEN, BLOCK))[None])
    hidden, _ = model(jnp.concatenate([tokens, tokens], axis=1), None, metadata)
    return model.logits(hidden)


def test_loss_falls(tiny_run):
    record, _ = tiny_run
    initial, first_interval, last = record["evals"][0], record["evals"][1], record["evals"][-1]
    assert record["steps"] == 20 and last["step"] == 20
    assert initial["heldout_loss"] > 8.5  # about ln(8000) at random init
    assert last["heldout_loss"] < initial["heldout_loss"] - 1.0
    assert last["train_loss"] < first_interval["train_loss"] - 0.5


def test_checkpoint_round_trips(tiny_run, tmp_path, monkeypatch):
    record, out = tiny_run
    trained = nnx.merge(record["graphdef"], train_tiny.cast_floats(record["params"], jnp.bfloat16))
    tokens = jnp.arange(100, 100 + SEQ_LEN, dtype=jnp.int32)[None]
    expected = two_stream_logits(trained, tokens)

    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["block_size"], config["max_position_embeddings"]) == ("sdar", BLOCK, SEQ_LEN)
    for name in train_tiny.TOKENIZER_FILES:
        assert (out / name).read_bytes() == (train_tiny.TOKENIZER_DIR / name).read_bytes()
    loaded = load_model(out, model_config(out), "bfloat16")
    np.testing.assert_array_equal(two_stream_logits(loaded, tokens), expected)

    monkeypatch.setattr(train_tiny, "MAX_SHARD_BYTES", 64 << 10)
    sharded = train_tiny.save_checkpoint(tmp_path, config, record["params"])
    assert len(list(sharded.glob("model-*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").exists()
    loaded = load_model(sharded, model_config(sharded), "bfloat16")
    np.testing.assert_array_equal(two_stream_logits(loaded, tokens), expected)


def test_heldout_files_are_disjoint_from_training():
    sources = train_tiny.stdlib_sources(train_tiny.stdlib_root())
    train, heldout = train_tiny.split_files(sources, 5)
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sources
    assert 0.02 < len(heldout) / len(sources) < 0.1
    # the choice hangs on the path alone, not on which other files the machine has
    assert train_tiny.split_files(sources[::-1][:200], 5)[1] == sorted(set(heldout) & set(sources[::-1][:200]),
                                                                        reverse=True)


def test_two_stream_mask_matches_block_diffusion_inference():
    seq_len, block = 16, 4
    mask = train_tiny.two_stream_mask(seq_len, block)
    for query in range(2 * seq_len):
        for key in range(2 * seq_len):
            query_block, key_block = (query % seq_len) // block, (key % seq_len) // block
            query_noisy, key_noisy = query < seq_len, key < seq_len
            if query_noisy:  # its own noisy block, and the clean prefix before it
                visible = query_block == key_block if key_noisy else key_block < query_block
            else:  # clean: block-causal over the clean stream only
                visible = not key_noisy and key_block <= query_block
            assert mask[query, key] == visible, (query, key)
