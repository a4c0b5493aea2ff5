import pytest
import torch

from pdkernels.out_proj import make_layer_counter, out_proj, out_proj_ref

# SmolLM2-135M's o_proj (576 -> 576) over a 128-token prefill chunk, with and without the layer counter
M, N, K = 128, 576, 576


@pytest.mark.benchmark(group="out_proj")
@pytest.mark.parametrize("provider", ["torch", "triton", "triton-no-counter"])
def test_out_proj(run, provider):
    x, w = torch.randn(M, K).half(), torch.randn(N, K).half()
    counter = None if provider == "triton-no-counter" else make_layer_counter(30)
    run(out_proj_ref if provider == "torch" else out_proj, x, w, counter=counter, layer=3)
