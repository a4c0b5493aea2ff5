"""fp32 linear layers on SmolLM2's weights, one thread: the fp32 GEMM against the int8 copy that
pdkernels.cpu keeps where the weights are exactly int8 blocks (GGUF's Q8_0 and Q4_1; cpu.Q8Weight), at
the rows decode steps have (M = 1 to 64; Q8_MAX_M = 32 takes the copy up to 32). Each round takes the
next of 8 layers' weights. Skipped without SmolLM2's GGUF or the C++ extension's AVX2 int8 kernel.
"""

import functools

import pytest
import torch

from pdkernels import cpu

WEIGHTS = {"gate": "mlp.gate_proj", "down": "mlp.down_proj", "q": "self_attn.q_proj"}


@functools.cache
def _weights(name: str) -> list:
    from engine.weights import load_model

    try:
        loaded = load_model("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    packed = [
        cpu.pack(loaded.weights[f"model.layers.{i}.{WEIGHTS[name]}.weight"].contiguous()) for i in range(8)
    ]
    if not isinstance(packed[0], cpu.Q8Weight):
        pytest.skip("no AVX2 int8 kernel here, or the weights are not int8 blocks")
    return packed


@pytest.mark.benchmark(group="int8-linear")
@pytest.mark.parametrize("path", ["fp32", "int8"])
@pytest.mark.parametrize("m", [1, 4, 12, 20, 32, 64])
@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_linear(benchmark, name, m, path):
    ws = _weights(name)
    x = torch.randn(m, ws[0].shape[1])
    ext = cpu.module()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    turn = iter(range(10**9))

    def call():
        w = ws[next(turn) % len(ws)]
        if path == "fp32":
            return torch.mm(x, w.data.t())
        return ext.q8_linear(x, w.q, w.scales, w.offsets, w.shape[0])

    try:
        benchmark.pedantic(call, rounds=100, warmup_rounds=5)
    finally:
        torch.set_num_threads(threads)
