"""jaxllm: a JAX/Pallas serving engine for diffusion language models."""

from jaxllm.llm import LLM, GenerationOutput
from jaxllm.sampling import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
