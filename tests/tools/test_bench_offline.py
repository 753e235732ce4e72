"""The offline benchmark's floor model and its count of the experts a batch touches."""

import json
import sys
import tempfile

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from tools.bench_offline import (
    MATMUL_RATE,
    first_difference_alone,
    forward_floor,
    forward_steps,
    main,
    measured_touched_experts,
    median_run,
    run,
    sharpen_attention,
)

BLOCK = 4


@pytest.fixture(scope="module")
def llada2(checkpoints):
    return LLM(checkpoints("llada2"), decoding_strategy="fixed_steps", denoising_steps=BLOCK, dtype="float32",
               block_size=BLOCK, max_num_seqs=2, max_model_len=64)


def test_touched_experts_are_the_union_of_the_batch_routing(llada2):
    moe = llada2.engine.model_config.moe
    prompts = [list(range(5, 13)), list(range(100, 108))]
    outputs = [o.token_ids for o in llada2.generate(prompts, SamplingParams(max_tokens=BLOCK, ignore_eos=True))]
    one = measured_touched_experts(llada2, prompts[:1], outputs[:1], seed=0)
    # the window's tokens do not all pick the same experts: more than one token's choices are counted
    assert moe.num_experts_per_tok < one <= min(moe.num_experts, BLOCK * moe.num_experts_per_tok)
    assert measured_touched_experts(llada2, prompts[:1] * 2, outputs[:1] * 2, seed=0) == one  # same tokens
    assert measured_touched_experts(llada2, prompts, outputs, seed=0) > one  # another prompt adds experts


def test_sharpened_attention_scales_only_the_q_and_k_norms_and_changes_the_output(llada2):
    runner = llada2.engine.runner
    original = list(runner.weights)
    prompts = [list(range(5, 13))]
    greedy = SamplingParams(max_tokens=2 * BLOCK, ignore_eos=True)
    before = llada2.generate(prompts, greedy)[0].token_ids
    try:
        sharpen_attention(llada2, 3.0)
        sharpened = llada2.generate(prompts, greedy)[0].token_ids
        scaled = {"q_norm": 0, "k_norm": 0, "other": 0}
        for (path, _), old, new in zip(jax.tree_util.tree_flatten_with_path(runner.params)[0], original,
                                       runner.weights):
            name = next((n for n in ("q_norm", "k_norm") if n in jax.tree_util.keystr(path)), "other")
            np.testing.assert_array_equal(np.asarray(new), np.asarray(old) * (1 if name == "other" else 3.0))
            scaled[name] += 1
    finally:
        runner.weights = original
    num_layers = llada2.engine.model_config.num_layers
    assert scaled["q_norm"] == scaled["k_norm"] == num_layers and scaled["other"] > 0
    assert sharpened != before


def test_touched_experts_of_an_output_shorter_than_a_block(llada2):
    prompts = [list(range(5, 13))]
    short = [o.token_ids for o in llada2.generate(prompts, SamplingParams(max_tokens=BLOCK // 2, ignore_eos=True))]
    assert len(short[0]) < BLOCK
    touched = measured_touched_experts(llada2, prompts, short, seed=0)
    assert llada2.engine.model_config.moe.num_experts_per_tok <= touched <= llada2.engine.model_config.moe.num_experts


def test_the_floor_reads_only_touched_experts(llada2):
    cfg = llada2.engine.model_config
    moe = cfg.moe
    expert_bytes = 2 * 3 * cfg.hidden_size * moe.moe_intermediate_size
    num_moe_layers = cfg.num_layers - moe.first_k_dense_replace
    few, more = (forward_floor(cfg, 1, BLOCK, 16, experts_touched=n) for n in (2, 5))
    assert more["bytes"] - few["bytes"] == pytest.approx(3 * num_moe_layers * expert_bytes)
    uniform = forward_floor(cfg, 1, BLOCK, 16)["bytes"]  # default: expected count under uniform routing
    assert few["bytes"] < uniform <= forward_floor(cfg, 1, BLOCK, 16, experts_touched=moe.num_experts)["bytes"]


def test_quantized_experts_halve_only_the_expert_bytes_of_the_floor(llada2):
    cfg = llada2.engine.model_config
    moe = cfg.moe
    expert_params = 3 * cfg.hidden_size * moe.moe_intermediate_size
    num_moe_layers = cfg.num_layers - moe.first_k_dense_replace
    bf16, int8 = (forward_floor(cfg, 1, BLOCK, 16, experts_touched=5, expert_weight_bytes=b)["bytes"] for b in (2, 1))
    assert bf16 - int8 == pytest.approx(5 * num_moe_layers * expert_params)  # attention, router, LM head stay bf16


@pytest.fixture(scope="module")
def full_llada2_config(tmp_path_factory):
    """LLaDA2.0-mini's shapes (config only, no weights)."""
    from jaxllm.models import model_config
    from tools.make_checkpoint import make_checkpoint
    return model_config(make_checkpoint(tmp_path_factory.mktemp("full"), "llada2", size="full", dtype="bf16",
                                        with_weights=False))


def test_the_op_floor_adds_what_compute_bound_steps_take_beyond_their_bytes(full_llada2_config):
    """At batch 32 the LM head is compute-bound: its rows cost the op floor their FLOPs while the whole-forward
    floor, bound by the experts' bytes, stays; at batch 1 every step is memory-bound and the two floors agree."""
    cfg = full_llada2_config
    few, many = (forward_floor(cfg, 32, 32, 528, experts_touched=256, logit_rows=rows) for rows in (512, 1024))
    assert few["floor_ms"] == many["floor_ms"] and few["bound"] == "memory"
    extra_flops = 2 * 512 * cfg.hidden_size * cfg.vocab_size
    assert many["op_floor_ms"] - few["op_floor_ms"] == pytest.approx(1e3 * extra_flops / MATMUL_RATE)
    assert few["op_floor_ms"] > few["floor_ms"]
    alone = forward_floor(cfg, 1, 32, 528, experts_touched=147)
    assert alone["op_floor_ms"] == pytest.approx(alone["floor_ms"])


def test_the_steps_read_every_matmul_weight_of_the_model_once(llada2):
    """With every expert touched, the steps' weight bytes are the model's own matmul weights (all but the embedding,
    which a forward only gathers rows of; the router counted as its float32 [H, E], not its three bf16 pieces)."""
    cfg = llada2.engine.model_config
    params = jax.tree_util.tree_flatten_with_path(llada2.engine.runner.params)[0]
    weight_bytes = 0
    for path, value in params:
        name = jax.tree_util.keystr(path)
        if "router_pieces" in name:  # bf16 [H, 3E] standing for the float32 router weight [H, E]
            weight_bytes += value.size // 3 * 4
        elif value.ndim >= 2 and "embed" not in name:
            weight_bytes += value.size * value.dtype.itemsize
    steps = forward_steps(cfg, 1, BLOCK, 0, weight_bytes=4, kv_bytes=0, experts_touched=cfg.moe.num_experts)
    assert sum(step.count * step.bytes for step in steps) == weight_bytes
    floor = forward_floor(cfg, 1, BLOCK, 0, weight_bytes=4, kv_bytes=0, experts_touched=cfg.moe.num_experts)
    assert floor["bytes"] == weight_bytes


def test_median_run_is_the_middle_run_with_the_spread():
    results = [dict(ms_per_forward=t, outputs=[[i]]) for i, t in enumerate([3.4, 3.1, 3.2])]
    middle = median_run(results)
    assert middle["ms_per_forward"] == 3.2 and middle["outputs"] == [[2]]
    assert middle["ms_spread"] == 0.3 and middle["ms_per_forward_runs"] == [3.4, 3.1, 3.2]
    assert median_run(results[:2])["ms_per_forward"] == 3.1  # an even count takes the lower middle


def test_sampling_options_reach_the_engine(llada2):
    """The timed run samples as asked: seeded draws repeat, and they are not the greedy tokens."""
    prompts = [list(range(5, 13))]
    greedy = run(llada2, prompts, 2 * BLOCK)["outputs"]
    sampling = dict(temperature=1.5, top_p=0.9, seed=3)
    first, second = (run(llada2, prompts, 2 * BLOCK, sampling=sampling)["outputs"] for _ in range(2))
    assert first == second != greedy


def test_the_command_runs_on_a_model_of_small_blocks(checkpoints, monkeypatch, capsys):
    """SDAR's 4-token blocks and pages, no --block-size: the pool is sized in the model's pages."""
    monkeypatch.setattr(sys, "argv", ["bench_offline", "--model", str(checkpoints("sdar")), "--dtype", "float32",
                                      "--input-len", "96", "--output-len", "8", "--repeats", "1"])
    main()
    header, row = capsys.readouterr().out.strip().splitlines()[-2:]
    result = dict(zip(header.split(" | "), row.split(" | ")))
    assert result["model"] == "sdar" and result["batch"] == "1" and result["block_size"] == "4"
    assert float(result["ms_per_forward"]) > 0
    assert {"op_floor_ms", "op_floor_ratio"} <= result.keys()


def test_a_prompt_decoded_alone_is_compared_with_its_tokens_in_the_batch(llada2):
    prompts = [list(range(5, 13)), list(range(100, 108))]
    in_batch = run(llada2, prompts, 2 * BLOCK)["outputs"][0]
    assert first_difference_alone(llada2, prompts[0], in_batch, 2 * BLOCK) is None  # float32: the same tokens
    changed = [*in_batch[:3], in_batch[3] + 1, *in_batch[4:]]
    assert first_difference_alone(llada2, prompts[0], changed, 2 * BLOCK) == 3
    assert first_difference_alone(llada2, prompts[0], in_batch[:5], 2 * BLOCK) == 5  # shorter: differs where it ends


def test_the_command_reports_batch_invariance(checkpoints, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["bench_offline", "--model", str(checkpoints("sdar")), "--dtype", "float32",
                                      "--input-len", "16", "--output-len", "8", "--repeats", "1", "--batch", "1", "2",
                                      "--check-batch-invariance", "--json", str(tmp_path / "rows.jsonl")])
    main()
    out = capsys.readouterr().out
    assert "batch 2: the first prompt decoded alone gives the same tokens" in out and "batch 1:" not in out
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert "first_difference_alone" not in rows[0] and rows[1]["first_difference_alone"] is None


def test_a_prompt_count_with_several_batch_sizes_is_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_offline", "--batch", "1", "4", "--num-prompts", "4"])
    with pytest.raises(SystemExit):
        main()


def test_the_checkpoint_it_makes_is_removed(tmp_path, monkeypatch, capsys):
    """Without --model it makes a checkpoint (32 GB at full size with weights): none may be left behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench_offline", "--arch", "sdar", "--dtype", "float32", "--input-len", "16",
                                      "--output-len", "4", "--repeats", "1"])
    main()
    assert "sdar | 1 |" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
