"""The serving engine: a Llama-family model on pdkernels, a paged KV cache, continuous batching."""

from engine.llm import LLM
from engine.sequence import RequestOutput, SamplingParams
from engine.structured import StructuredOutputs

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputs"]
