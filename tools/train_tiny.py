"""Train the small SDAR block-diffusion model shipped as jaxllm/default_model, on CPython's standard-library sources.

Data: every `*.py` under `sysconfig.get_paths()["stdlib"]` or `--stdlib-root` (site-/dist-packages excluded), tokenized
with the project tokenizer and joined with `<|endoftext|>`. Whole files are held out for evaluation by a stable hash of
their relative path. Training windows are random crops of the training stream.

Objective (block diffusion, two streams): the model sees [noisy ; clean] (length 2T, positions 0..T-1 twice). In
the noisy half every block b draws a mask ratio t ~ U(eps, 1) and masks each of its tokens with probability t. A
noisy token of block b sees the noisy tokens of block b and the clean tokens of blocks < b; a clean token of block b
sees the clean tokens of blocks <= b, which is the attention of block-causal inference with a committed prefix. The
loss is the mean cross-entropy over the masked noisy positions (in place: logits[i] predicts token i), unweighted:
the 1/t ELBO weighting puts large weights on the few masked tokens of low-t blocks, a noisier gradient than a short
run can afford, and the plain mean is what held-out masked-token accuracy tracks.

Optimisation: optax AdamW, linear warm-up then cosine decay, global-norm clipping, float32 master weights and
bfloat16 compute (the dtype the engine serves in, and the H200's fast path). The cosine horizon is fitted to the
wall-clock budget after a short timing of real steps, so a `--max-minutes` run still ends its schedule.

    python -m tools.train_tiny --out /tmp/tiny --seed 0 --stdlib-root /tmp/lib/python3.11 --attention cudnn \
        --max-minutes 3.6     # the shipped run: H200, CPython 3.11 Lib/ unpacked in /tmp/lib, 24.8 ms/step, 6,634 steps
    python -m tools.train_tiny --preset test --steps 40 --batch 8 --seq-len 32 --max-files 40 --out /tmp/t  # CPU

The output directory is an HF-format SDAR checkpoint (Qwen3 keys, bf16 safetensors, sharded when needed) with the
project tokenizer copied in; `jaxllm.LLM(out_dir)` serves it.
"""

import argparse
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from jaxllm.loader import ConcatTransposed, transpose, unchanged
from jaxllm.models import sdar
from jaxllm.models.layers import DenseMetadata, Embedding
from tools.device_profile import device_kernel_times, print_kernel_table

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "jaxllm" / "default_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EOS_ID, MASK_ID = 0, 1
NUM_SPECIAL_IDS = 4  # <|endoftext|>, <|mask|>, <|im_start|>, <|im_end|>: never targets in source text
TOKENIZER_VOCAB = 8000  # ids the tokenizer can produce; the model's vocab_size pads this to 8192
MAX_SHARD_BYTES = 12 << 20  # each safetensors file stays well under 15 MiB

PRESETS = {
    # about 0.6M parameters: CPU tests
    "test": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16},
    # about 8.4M parameters (2.1M of them the tied embedding): the shipped default model
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64},
}


# corpus

def stdlib_root(override: Path | None = None) -> Path:
    """The standard library to train on: this interpreter's unless another (e.g. an unpacked copy) is named."""
    return override or Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> list[str]:
    """Relative POSIX paths of the standard library's .py files, sorted; installed third-party packages excluded."""
    paths = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if not {"site-packages", "dist-packages"} & set(relative.parts):
            paths.append(relative.as_posix())
    return sorted(paths)


def is_heldout(relative_path: str, holdout_percent: int) -> bool:
    """A stable choice (the same on every machine and Python) of about holdout_percent% of the files."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "little") % 100 < holdout_percent


def split_files(relative_paths: list[str], holdout_percent: int) -> tuple[list[str], list[str]]:
    heldout = [p for p in relative_paths if is_heldout(p, holdout_percent)]
    train = [p for p in relative_paths if not is_heldout(p, holdout_percent)]
    return train, heldout


def read_sources(root: Path, relative_paths: list[str]) -> list[str]:
    """File texts; files that are not UTF-8 (a few deliberate test fixtures) are skipped."""
    texts = []
    for relative in relative_paths:
        try:
            texts.append((root / relative).read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def token_stream(texts: list[str], tokenizer: Tokenizer) -> np.ndarray:
    """i32[N]: the files' tokens, each file followed by <|endoftext|>. Files that spell a special token are dropped."""
    pieces = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids = np.asarray(encoding.ids, np.int32)
        if ids.size and ids.min() >= NUM_SPECIAL_IDS:
            pieces += [ids, np.array([EOS_ID], np.int32)]
    return np.concatenate(pieces)


# model

def hf_config(preset: str, seq_len: int, block_size: int) -> dict:
    return {
        "architectures": ["SDARForCausalLM"], "model_type": sdar.MODEL_TYPE, "vocab_size": 8192,
        **PRESETS[preset], "hidden_act": "silu", "max_position_embeddings": seq_len, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": True,
        "block_size": block_size, "mask_token_id": MASK_ID, "bos_token_id": EOS_ID, "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID, "torch_dtype": "bfloat16",
    }


def two_stream_mask(seq_len: int, block_size: int) -> np.ndarray:
    """bool[2T, 2T]: query i may see key j, for the sequence [noisy ; clean] (module docstring)."""
    block = np.arange(seq_len) // block_size
    same_block = block[:, None] == block[None, :]
    earlier_block = block[:, None] > block[None, :]
    top = np.concatenate([same_block, earlier_block], axis=1)  # noisy queries: [noisy keys | clean keys]
    bottom = np.concatenate([np.zeros_like(same_block), same_block | earlier_block], axis=1)  # clean queries
    return np.concatenate([top, bottom], axis=0)


class OneHotEmbedding(Embedding):
    """The token embedding as a one-hot matmul, for training only. A gather's gradient is a scatter-add into the
    bf16 table that XLA serialises on repeated tokens: 80% of an H200 step (87 of 109 ms); a GEMM's is a GEMM.
    It holds the same parameter as the model's Embedding, so checkpoints and serving are unchanged."""

    def __init__(self, embedding: Embedding):  # adopts the table and mode; attend (the tied LM head) is inherited
        self.embedding, self.batch_invariant = embedding.embedding, embedding.batch_invariant

    def __call__(self, tokens):
        table = self.embedding[...]
        return jnp.dot(jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype), table)


def training_model(config: dict, seed: int) -> sdar.SDAR:
    """The SDAR to train: float32 master weights, one-hot embedding lookup."""
    model = sdar.SDAR(sdar.config_from_hf(config), dtype=jnp.float32, rngs=nnx.Rngs(seed))
    model.embed = OneHotEmbedding(model.embed)
    return model


def cast_floats(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def noisy_logits(graphdef, params, noisy, clean, mask, compute_dtype, attention_impl):
    """f32[B, T, V] logits of the noisy half; padded vocab rows and the mask id are pushed to -inf."""
    batch, seq_len = clean.shape
    model = nnx.merge(graphdef, cast_floats(params, compute_dtype))
    positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), 2)
    metadata = DenseMetadata(positions=jnp.broadcast_to(positions, (batch, 2 * seq_len)), mask=mask[None],
                             attention_impl=attention_impl)
    hidden, _ = model(jnp.concatenate([noisy, clean], axis=1), None, metadata)
    logits = model.logits(hidden[:, :seq_len])
    vocab = jnp.arange(logits.shape[-1])
    return jnp.where((vocab < TOKENIZER_VOCAB) & (vocab != MASK_ID), logits, -1e9)


def masked_loss(logits, clean, is_masked):
    """(mean cross-entropy, accuracy) over the masked positions."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    token_nll = -jnp.take_along_axis(log_probs, clean[..., None], axis=-1)[..., 0]
    count = jnp.maximum(is_masked.sum(), 1)
    correct = (jnp.argmax(logits, axis=-1) == clean) & is_masked
    return jnp.sum(token_nll * is_masked) / count, correct.sum() / count


def block_diffusion_noise(key, clean, block_size: int, mask_eps: float):
    """(noisy tokens, is_masked): per block t ~ U(eps, 1), each token masked with probability t."""
    batch, seq_len = clean.shape
    ratio_key, token_key = jax.random.split(key)
    ratios = jax.random.uniform(ratio_key, (batch, seq_len // block_size), minval=mask_eps, maxval=1.0)
    is_masked = jax.random.uniform(token_key, clean.shape) < jnp.repeat(ratios, block_size, axis=1)
    return jnp.where(is_masked, MASK_ID, clean), is_masked


# training

def learning_rate(step: int, total_steps: int, peak: float, warmup_steps: int, final_fraction: float = 0.1) -> float:
    """Linear warm-up to peak, then cosine decay to final_fraction * peak at total_steps."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(params, weight_decay: float, clip_norm: float):
    """AdamW at learning rate 1; the train step scales its update by the scheduled rate, which is exactly AdamW at
    that rate (optax applies decoupled weight decay before the learning-rate scale). Decay only matrices."""
    def is_matrix(path, _) -> bool:
        name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
        return name in ("kernel", "embedding")

    decay_mask = jax.tree_util.tree_map_with_path(is_matrix, params)
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask))


def make_train_step(graphdef, optimizer, mask, args):
    compute_dtype = jnp.bfloat16 if args.compute_dtype == "bf16" else jnp.float32

    def loss_fn(params, noisy, clean, is_masked):
        logits = noisy_logits(graphdef, params, noisy, clean, mask, compute_dtype, args.attention)
        return masked_loss(logits, clean, is_masked)

    def train_step(params, opt_state, tokens, base_key, step, lr):
        key = jax.random.fold_in(base_key, step)
        window_key, noise_key = jax.random.split(key)
        starts = jax.random.randint(window_key, (args.batch, 1), 0, tokens.shape[0] - args.seq_len)
        clean = tokens[starts + jnp.arange(args.seq_len)]  # [B, T]
        noisy, is_masked = block_diffusion_noise(noise_key, clean, args.block_size, args.mask_eps)
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, noisy, clean, is_masked)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, jax.tree.map(lambda u: lr * u, updates))
        return params, opt_state, loss

    return jax.jit(train_step, donate_argnums=(0, 1))


def heldout_batches(tokens: np.ndarray, num_windows: int, seq_len: int, batch: int, seed: int):
    """Evenly spaced held-out windows with a fixed mask at ratio 0.5: [(clean i32[b, T], is_masked bool[b, T])]."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, num_windows).astype(np.int64)
    clean = tokens[starts[:, None] + np.arange(seq_len)]
    is_masked = np.random.default_rng(seed).random(clean.shape) < 0.5
    return [(clean[i:i + batch], is_masked[i:i + batch]) for i in range(0, num_windows, batch)]


def make_eval_step(graphdef, mask, args):
    compute_dtype = jnp.bfloat16 if args.compute_dtype == "bf16" else jnp.float32

    def eval_step(params, clean, is_masked):
        noisy = jnp.where(is_masked, MASK_ID, clean)
        logits = noisy_logits(graphdef, params, noisy, clean, mask, compute_dtype, args.attention)
        loss, accuracy = masked_loss(logits, clean, is_masked)
        return loss * is_masked.sum(), accuracy * is_masked.sum(), is_masked.sum()

    eval_step = jax.jit(eval_step)

    def evaluate(params, batches) -> tuple[float, float]:
        totals = np.zeros(3)
        for clean, is_masked in batches:
            totals += np.array([float(x) for x in eval_step(params, clean, is_masked)])
        return totals[0] / totals[2], totals[1] / totals[2]

    return evaluate


def fitted_total_steps(step: int, seconds_per_step: float, seconds_left: float, max_steps: int) -> int:
    return max(step + 1, min(max_steps, step + int(seconds_left / seconds_per_step)))


def train(args) -> dict:
    """Train, save the checkpoint to args.out, and return the run's record with the trained parameters."""
    started = time.perf_counter()
    log = print if not args.quiet else (lambda *a, **k: None)
    train_tokens, heldout_tokens, record = load_corpus(args, started, log)
    config = hf_config(args.preset, args.seq_len, args.block_size)
    model = training_model(config, args.seed)
    graphdef, params = nnx.split(model)
    record["num_params"] = sum(x.size for x in jax.tree.leaves(params))
    log(f"model: {record['num_params']:,} parameters, preset {args.preset}, block {args.block_size}, "
        f"device {jax.devices()[0].device_kind}", flush=True)

    params, step = train_loop(args, graphdef, params, train_tokens, heldout_tokens, record, started, log)
    record |= {"steps": step, "train_tokens_seen": step * args.batch * args.seq_len,
               "seconds": round(time.perf_counter() - started, 1)}
    save_checkpoint(args.out, config, params)
    log(f"saved {args.out} after {step} steps, {record['train_tokens_seen']:,} tokens, {record['seconds']}s",
        flush=True)
    log("record: " + json.dumps(record), flush=True)
    return record | {"params": params, "graphdef": graphdef}


def load_corpus(args, started: float, log) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train stream, held-out stream, the run's record so far)."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    root = stdlib_root(args.stdlib_root)
    train_files, heldout_files = split_files(stdlib_sources(root)[:args.max_files], args.holdout_percent)
    train_tokens = token_stream(read_sources(root, train_files), tokenizer)
    heldout_tokens = token_stream(read_sources(root, heldout_files), tokenizer)
    log(f"corpus: the standard library at {root}: {len(train_files)} train files "
        f"({len(train_tokens):,} tokens), {len(heldout_files)} held-out files ({len(heldout_tokens):,} tokens); "
        f"tokenized in {time.perf_counter() - started:.1f}s", flush=True)
    record = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "python": sys.version.split()[0], "stdlib": str(root), "train_files": len(train_files),
              "heldout_files": len(heldout_files), "train_tokens": len(train_tokens),
              "heldout_tokens": len(heldout_tokens), "evals": []}
    return train_tokens, heldout_tokens, record


def train_loop(args, graphdef, params, train_tokens, heldout_tokens, record: dict, started: float, log):
    """Steps until args.steps, the fitted schedule's end or the deadline; evals go to record["evals"]."""
    deadline = started + 60 * args.max_minutes
    optimizer = make_optimizer(params, args.weight_decay, args.clip_norm)
    opt_state = optimizer.init(params)
    mask = jnp.asarray(two_stream_mask(args.seq_len, args.block_size))
    train_step = make_train_step(graphdef, optimizer, mask, args)
    evaluate = make_eval_step(graphdef, mask, args)
    eval_batches = heldout_batches(heldout_tokens, args.eval_windows, args.seq_len, args.batch, args.seed)
    device_tokens = jnp.asarray(train_tokens)
    base_key = jax.random.key(args.seed)

    total_steps, step, losses, timing_start, lr = args.steps, 0, [], None, 0.0
    record["evals"].append(_log_eval(0, total_steps, lr, [], evaluate(params, eval_batches), started, log))
    while step < total_steps and time.perf_counter() < deadline:
        lr = np.float32(learning_rate(step, total_steps, args.lr, args.warmup_steps))
        params, opt_state, loss = train_step(params, opt_state, device_tokens, base_key, np.int32(step), lr)
        losses.append(loss)
        step += 1
        if step % 10 == 0:  # keep the host from queueing far past the deadline
            jax.block_until_ready(loss)
        if step == args.timing_from:  # compilation is behind us: time real steps from here
            jax.block_until_ready(loss)
            timing_start = time.perf_counter()
        if step == args.timing_from + args.timing_steps:
            total_steps = _fit_schedule(args, step, loss, timing_start, deadline, log)
        if step % args.eval_interval == 0 or step == total_steps:
            record["evals"].append(_log_eval(step, total_steps, lr, losses, evaluate(params, eval_batches),
                                             started, log))
            losses = []
    if record["evals"][-1]["step"] != step:  # stopped by the clock between evals
        record["evals"].append(_log_eval(step, total_steps, lr, losses, evaluate(params, eval_batches), started, log))
    return params, step


def _fit_schedule(args, step: int, loss, timing_start: float, deadline: float, log) -> int:
    """The total step count that the time left affords, from the measured speed of the timed steps."""
    jax.block_until_ready(loss)
    seconds_per_step = (time.perf_counter() - timing_start) / args.timing_steps
    seconds_left = (deadline - time.perf_counter()) * (1 - args.eval_reserve) - args.save_seconds
    total_steps = fitted_total_steps(step, seconds_per_step, seconds_left, args.steps)
    log(f"timing: {1e3 * seconds_per_step:.1f} ms/step, {args.batch * args.seq_len / seconds_per_step:,.0f} "
        f"tokens/s; schedule fitted to {total_steps} steps", flush=True)
    return total_steps


def _log_eval(step, total_steps, lr, losses, heldout, started, log) -> dict:
    train_loss = float(np.mean(jax.device_get(losses))) if losses else float("nan")
    entry = {"step": step, "lr": float(lr), "train_loss": round(train_loss, 4),
             "heldout_loss": round(heldout[0], 4), "heldout_accuracy": round(heldout[1], 4),
             "elapsed_s": round(time.perf_counter() - started, 1)}
    log(f"step {step}/{total_steps} lr {lr:.2e} train_loss {train_loss:.4f} heldout_loss(t=0.5) {heldout[0]:.4f} "
        f"heldout_acc(t=0.5) {heldout[1]:.4f} elapsed {entry['elapsed_s']}s", flush=True)
    return entry


# checkpoint

def checkpoint_tensors(config: dict, params) -> dict[str, np.ndarray]:
    """HF key -> bf16 array, through sdar.hf_weight_map, inverted: transpose and unchanged are their own inverses,
    and a concatenated parameter splits back into its tensors."""
    cfg = sdar.config_from_hf(config)
    flat = {"/".join(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]}
    tensors = {}
    for path, spec in sdar.hf_weight_map(cfg).items():
        assert spec.experts is None, path
        if isinstance(spec.convert, ConcatTransposed):
            pieces = spec.convert.split(flat[path])
        else:
            assert spec.convert in (transpose, unchanged) and len(spec.keys) == 1, path
            pieces = [spec.convert(flat[path])]
        for key, piece in zip(spec.keys, pieces, strict=True):
            tensors[key] = np.ascontiguousarray(piece).astype(ml_dtypes.bfloat16)
    return tensors


def shard(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """Consecutive groups of tensors, each at most max_bytes (a larger single tensor gets a file of its own)."""
    shards, current, current_bytes = [], {}, 0
    for key, value in tensors.items():
        if current and current_bytes + value.nbytes > max_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[key] = value
        current_bytes += value.nbytes
    return shards + [current]


def save_checkpoint(out_dir, config: dict, params) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    tensors = checkpoint_tensors(config, params)
    shards = shard(tensors, MAX_SHARD_BYTES)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, tensors_of_shard in zip(names, shards):
        save_file(tensors_of_shard, out_dir / name, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": {key: name for name, group in zip(names, shards) for key in group}}
        _write_json(out_dir / "model.safetensors.index.json", index)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": EOS_ID, "eos_token_id": [EOS_ID], "pad_token_id": EOS_ID})
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, out_dir / name)
    return out_dir


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=20000, help="at most this many steps (the clock may stop first)")
    parser.add_argument("--max-minutes", type=float, default=4.5,
                        help="wall-clock budget, tokenizing and saving included")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512,
                        help="training context; the model's max_position_embeddings")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--mask-eps", type=float, default=1e-3, help="lower bound of the per-block mask ratio")
    parser.add_argument("--compute-dtype", choices=["bf16", "f32"], default="bf16")
    parser.add_argument("--attention", choices=["xla", "cudnn"], default="xla",
                        help="jax.nn.dot_product_attention backend; cudnn is GPU flash attention (bf16)")
    parser.add_argument("--stdlib-root", type=Path, default=None,
                        help="train on this copy of a CPython Lib/ directory instead of the running interpreter's")
    parser.add_argument("--eval-interval", type=int, default=250)
    parser.add_argument("--eval-windows", type=int, default=128, help="held-out windows of seq-len tokens")
    parser.add_argument("--holdout-percent", type=int, default=5)
    parser.add_argument("--max-files", type=int, default=None, help="use only the first N source files (tests)")
    parser.add_argument("--timing-from", type=int, default=10, help="first step of the timing that fits the schedule")
    parser.add_argument("--timing-steps", type=int, default=40)
    parser.add_argument("--eval-reserve", type=float, default=0.08, help="fraction of the time left kept for evals")
    parser.add_argument("--save-seconds", type=float, default=10.0, help="time kept for the final eval and the save")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="instead of training, profile this many steps on random tokens; print the slowest kernels")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.seq_len % args.block_size:
        raise SystemExit(f"--seq-len ({args.seq_len}) must be a multiple of --block-size ({args.block_size})")
    if args.profile_steps:
        profile_steps(args)
    else:
        train(args)


def profile_steps(args) -> None:
    """Time args.profile_steps training steps after a warm-up and print where the device time goes."""
    tokens = jnp.arange(100_000, dtype=jnp.int32) % TOKENIZER_VOCAB  # the data does not change the kernels
    model = training_model(hf_config(args.preset, args.seq_len, args.block_size), args.seed)
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(params, args.weight_decay, args.clip_norm)
    opt_state = optimizer.init(params)
    train_step = make_train_step(graphdef, optimizer, jnp.asarray(two_stream_mask(args.seq_len, args.block_size)), args)
    key, lr = jax.random.key(args.seed), np.float32(args.lr)

    def steps(first: int, count: int):
        nonlocal params, opt_state
        for step in range(first, first + count):
            params, opt_state, loss = train_step(params, opt_state, tokens, key, np.int32(step), lr)
        jax.block_until_ready(loss)

    steps(0, 3)
    start = time.perf_counter()
    steps(3, args.profile_steps)
    print(f"{1e3 * (time.perf_counter() - start) / args.profile_steps:.1f} ms/step unprofiled", flush=True)
    profile = device_kernel_times(lambda: steps(3, args.profile_steps), ("dot_product_attention", "transpose"))
    print_kernel_table(*profile, top=25, per=args.profile_steps, unit="step")


if __name__ == "__main__":
    main()
