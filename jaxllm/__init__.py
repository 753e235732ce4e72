"""jaxllm: a JAX/Pallas serving engine for diffusion language models."""

import importlib

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
# where each export lives: importing `jaxllm` (or a light submodule such as jaxllm.config, as the command line does
# before it has checked its flags) loads JAX, the engine and transformers only when one of these is first used
_EXPORTS = {"LLM": "jaxllm.llm", "GenerationOutput": "jaxllm.llm", "SamplingParams": "jaxllm.sampling"}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
