"""bf16 linear layers on SmolLM2's weights, one thread: every projection of a step (30 layers' qkv, o,
gate_up and down, and the LM head, each weight distinct so that they stream from memory as in a step)
through oneDNN's packed copy against the panels pdkernels.cpu keeps on AVX-512 BF16 CPUs without AMX
(cpu.PanelWeight, linear_cpu.cpp's bf16_linear), at the rows decode steps have (M = 1 to 64: PANEL_MAX_M =
32 takes the panels up to 32) and mixed and prefill steps have (256, 1,024). Skipped without SmolLM2's GGUF
or the panels.
"""

import functools

import pytest
import torch

from pdkernels import cpu


@functools.cache
def _model():
    from engine import LLM

    if not cpu.panels_serve():
        pytest.skip("no bf16 panels here (AVX-512 BF16 without AMX, the C++ extension built)")
    try:
        llm = LLM("smollm2-135m", device="cpu", dtype="bfloat16", num_pages=8, enable_prefix_caching=False)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model = llm.model
    return [layer[k] for layer in model.layers for k in ("qkv", "o", "gate_up", "down")] + [model.lm_head]


@pytest.mark.benchmark(group="bf16-linear")
@pytest.mark.parametrize("path", ["onednn", "panels"])
@pytest.mark.parametrize("m", [1, 4, 12, 20, 32, 64, 256, 1024])
def test_a_steps_projections(benchmark, m, path):
    weights = _model()
    ext = cpu.module()
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {w.shape[1] for w in weights}}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def call():
        for w in weights:
            x = xs[w.shape[1]]
            if path == "onednn":
                ext.packed_linear(x, w.data)
            else:
                ext.bf16_linear(x, w.panels, w.shape[0])

    try:
        benchmark.pedantic(call, rounds=20, warmup_rounds=2)
    finally:
        torch.set_num_threads(threads)
