import pytest
import torch

from pdkernels.splitk_gemm import splitk_gemm, splitk_gemm_ref

# SmolLM2-135M's MLP up-projection (576 -> 1536) at decode batch sizes; FLOPs 2*M*N*K
N, K = 1536, 576


@pytest.mark.benchmark(group="splitk_gemm")
@pytest.mark.parametrize("provider", ["torch", "triton"])
@pytest.mark.parametrize("m", [1, 16])
def test_splitk_gemm(run, provider, m):
    x, w = torch.randn(m, K).half(), torch.randn(N, K).half()
    run(splitk_gemm if provider == "triton" else splitk_gemm_ref, x, w)
