"""The offline API: LLM(model_dir, ...).generate(prompts, SamplingParams(...)), in the shape vLLM users know."""

import dataclasses
import numbers
import pathlib

from jaxllm.config import DEFAULT_MODEL_DIR, ConfigError, split_options
from jaxllm.engine.engine import LLMEngine
from jaxllm.sampling import SamplingParams


@dataclasses.dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: dict  # forward_passes, tokens_per_forward, timings

    @property
    def forward_passes(self) -> int:
        return self.stats["forward_passes"]

    @property
    def tokens_per_forward(self) -> float | None:
        return self.stats["tokens_per_forward"]


class LLM:
    """Offline batch generation. Options are EngineConfig and DecodingConfig fields
    (decoding_strategy, block_size, denoising_steps, threshold, dtype, max_num_seqs, ...)."""

    def __init__(self, model: str | pathlib.Path | None = None, *, random_weights: bool = False, warmup: bool = False,
                 **options):
        engine_config, decoding_config = split_options(options)
        if engine_config.max_queue_time is not None:
            raise ConfigError("max_queue_time is a serving limit; LLM.generate queues all its prompts at once")
        self.engine = LLMEngine(model or DEFAULT_MODEL_DIR, engine_config, decoding_config,
                                random_weights=random_weights)
        if warmup:
            self.engine.warmup()

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        elif len(prompts) and isinstance(prompts[0], numbers.Integral):  # one prompt of token ids (numpy's too)
            prompts = [list(prompts)]
        prompts = [p if isinstance(p, str) else list(p) for p in prompts]  # a tuple or an array of ids is one prompt
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
        ids, own, finished = [], set(), {}

        def step():
            for output in self.engine.step():
                if output.finished and output.request_id in own:
                    finished[output.request_id] = output

        try:
            for prompt, p in zip(prompts, params):
                # the waiting queue's limit protects a server; an offline call steps until its next prompt fits
                while self.engine.num_waiting >= self.engine.config.max_waiting_requests:
                    step()
                ids.append(self.engine.add_request(prompt, p))
                own.add(ids[-1])
        except Exception:  # a refused prompt leaves none of this call's requests behind
            for request_id in ids:
                self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        while len(finished) < len(ids):
            step()
        return [GenerationOutput(finished[i].prompt_token_ids, finished[i].text, finished[i].token_ids,
                                 finished[i].finish_reason, finished[i].stats) for i in ids]
