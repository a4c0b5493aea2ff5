import pytest
import torch

from pdkernels.decode_attention import decode_attention, decode_attention_ref
from pdkernels.testing import make_paged_cache

# SmolLM2-135M: 9 q heads over 3 kv heads of 64; 8 sequences of 256-1024 tokens in pages of 16
SEQ_LENS = [256, 300, 512, 700, 1024, 400, 333, 999]


@pytest.mark.benchmark(group="decode_attention")
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_decode_attention(run, provider):
    case = make_paged_cache(SEQ_LENS, 3, 64, 16, dtype=torch.float16)
    q = torch.randn(len(SEQ_LENS), 9, 64).half()
    fn = decode_attention if provider == "triton" else decode_attention_ref
    run(fn, q, case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
