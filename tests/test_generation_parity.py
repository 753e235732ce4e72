"""Greedy fixed_steps generation equals, token for token, a cacheless PyTorch loop.

The reference recomputes the whole sequence (prompt, committed blocks, current block with its masks) with the
PyTorch stand-in at every step, under the 4D block-causal mask, and commits the k_t most confident masked positions
of the current block (ties to the lower position). The engine does the same with a paged KV cache, jitted rounds and
several prompts batched together. The LM head is scaled up so the model is confident enough that every decision's
margin is far above float32 noise; the test asserts that margin, so a near-tie cannot pass or fail it by luck.
"""

import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from tests.models import torch_reference

BLOCK_SIZE = 4
STEPS = 3  # fewer steps than masks: some steps commit two tokens
MAX_TOKENS = 10
MASK_ID = 1
MIN_MARGIN = 1e-4


@torch.no_grad()
def reference_generate(model, prompt: list[int], num_real_tokens: int) -> tuple[list[int], float]:
    """Cacheless fixed_steps decoding; returns the generated tokens and the smallest decision margin seen."""
    first_block = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    end = -(-(len(prompt) + MAX_TOKENS) // BLOCK_SIZE) * BLOCK_SIZE
    seq = prompt + [MASK_ID] * (end - len(prompt))
    smallest_margin = np.inf
    for start in range(first_block, end, BLOCK_SIZE):
        block = np.arange(start, start + BLOCK_SIZE)
        num_masks = sum(seq[p] == MASK_ID for p in block)
        for step in range(STEPS):
            k = num_masks // STEPS + (step < num_masks % STEPS)
            if k == 0:
                continue
            logits = torch_reference.logits(model, seq[:start + BLOCK_SIZE], BLOCK_SIZE)[block]
            logits[:, MASK_ID] = -np.inf
            logits[:, num_real_tokens:] = -np.inf
            probs = torch.softmax(torch.from_numpy(logits), dim=-1).numpy()
            candidates = probs.argmax(-1)
            confidence = np.where([seq[p] == MASK_ID for p in block], probs.max(-1), -np.inf)
            order = sorted(range(BLOCK_SIZE), key=lambda i: (-confidence[i], i))
            for i in order[:k]:
                seq[block[i]] = int(candidates[i])
                top2 = np.sort(probs[i])[-2:]
                smallest_margin = min(smallest_margin, top2[1] - top2[0])
            if len(order) > k and np.isfinite(confidence[order[k]]):
                smallest_margin = min(smallest_margin, confidence[order[k - 1]] - confidence[order[k]])
    return seq[len(prompt):len(prompt) + MAX_TOKENS], smallest_margin


@pytest.mark.parametrize("arch", ["sdar", "llada2"])
def test_greedy_fixed_steps_matches_cacheless_pytorch_loop(checkpoints, arch):
    path = checkpoints(arch, lm_head_scale=60)
    make_torch = torch_reference.qwen3_from_sdar if arch == "sdar" else torch_reference.glm4moe_from_llada2
    torch_model = make_torch(path)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 8000, n).tolist() for n in (3, 8, 13)]  # tails of 3, 0 and 1 tokens

    llm = LLM(path, dtype="float32", decoding_strategy="fixed_steps", denoising_steps=STEPS, block_size=BLOCK_SIZE,
              max_num_seqs=4, max_model_len=64)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))

    for prompt, output in zip(prompts, outputs):
        expected, margin = reference_generate(torch_model, prompt, len(llm.engine.tokenizer))
        assert margin > MIN_MARGIN, f"the reference hit a near-tie (margin {margin:.2e}); pick another seed"
        assert output.token_ids == expected
        assert output.finish_reason == "length"
