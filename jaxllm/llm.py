"""The offline API: LLM(model_dir, ...).generate(prompts, SamplingParams(...)), in the shape vLLM users know."""

import dataclasses
import pathlib
import typing

from jaxllm.config import ConfigError, DecodingConfig, EngineConfig
from jaxllm.engine.engine import LLMEngine
from jaxllm.sampling import SamplingParams

DEFAULT_MODEL_DIR = pathlib.Path(__file__).parent / "default_model"


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


_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
_DECODING_FIELDS = {f.name for f in dataclasses.fields(DecodingConfig)}


def split_options(options: dict[str, typing.Any]) -> tuple[EngineConfig, DecodingConfig]:
    """Route keyword options to EngineConfig or DecodingConfig; an unknown option is an error.

    decoding_preset ("quality" or "speed") starts from LLaDA2.1's joint_threshold settings; explicit decoding
    options override them."""
    options = dict(options)
    if "decoding_strategy" in options:
        options["strategy"] = options.pop("decoding_strategy")
    preset = options.pop("decoding_preset", None)
    unknown = set(options) - _ENGINE_FIELDS - _DECODING_FIELDS
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}")
    engine = EngineConfig(**{k: v for k, v in options.items() if k in _ENGINE_FIELDS})
    decoding_options = {k: v for k, v in options.items() if k in _DECODING_FIELDS}
    if preset is None:
        return engine, DecodingConfig(**decoding_options)
    if decoding_options.pop("strategy", "joint_threshold") != "joint_threshold":
        raise ConfigError(f"decoding_preset={preset!r} is a joint_threshold preset; it takes no other strategy")
    return engine, DecodingConfig.joint_threshold_preset(preset, **decoding_options)


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
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        ids = [self.engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        finished = {}
        while len(finished) < len(ids):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [GenerationOutput(finished[i].prompt_token_ids, finished[i].text, finished[i].token_ids,
                                 finished[i].finish_reason, finished[i].stats) for i in ids]
