"""The serving engine: a Llama-family model on pdkernels, a paged KV cache, continuous batching.

`from engine import LLM` loads the engine (torch, the model code) on first use: a light part such as
`engine.role` imports without it (the router and the simulator read roles)."""

__all__ = ["DPLLM", "LLM", "RequestOutput", "SamplingParams", "StructuredOutputs", "make_llm"]
_WHERE = {
    "DPLLM": "engine.dp",
    "LLM": "engine.llm",
    "make_llm": "engine.dp",
    "RequestOutput": "engine.sequence",
    "SamplingParams": "engine.sequence",
    "StructuredOutputs": "engine.structured",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
