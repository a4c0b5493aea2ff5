import pytest
import torch

from pdkernels.extend_attention import extend_attention, extend_attention_ref
from pdkernels.testing import make_paged_cache

# SmolLM2-135M geometry; two requests, each a 64-token chunk on top of a cached prefix
SEQ_LENS, Q_LENS = [192, 320], [64, 64]


@pytest.mark.benchmark(group="extend_attention")
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_extend_attention(run, provider):
    case = make_paged_cache(SEQ_LENS, 3, 64, 16, dtype=torch.float16)
    qo_indptr = torch.tensor([0] + Q_LENS).cumsum(0).to(torch.int32)
    q = torch.randn(sum(Q_LENS), 9, 64).half()
    fn = extend_attention if provider == "triton" else extend_attention_ref
    run(fn, q, qo_indptr, case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
