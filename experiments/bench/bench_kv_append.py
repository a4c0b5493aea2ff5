import pytest
import torch

from pdkernels.kv_append import kv_append, kv_append_ref
from pdkernels.testing import append_positions, make_paged_cache

# SmolLM2-135M's KV geometry: 3 kv heads of 64; a 128-token prefill chunk for each of 4 requests
SEQ_LENS, APPEND, HEADS, DIM = [128, 256, 300, 512], [128, 128, 128, 128], 3, 64


@pytest.mark.benchmark(group="kv_append")
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_kv_append(run, provider):
    case = make_paged_cache(SEQ_LENS, HEADS, DIM, 16, dtype=torch.float16)
    batch_indices, positions = append_positions(case, APPEND)
    k = torch.randn(positions.numel(), HEADS, DIM).half()
    fn = kv_append if provider == "triton" else kv_append_ref
    run(
        fn, k, k, batch_indices, positions, case.cache, case.kv_indices, case.kv_indptr, case.kv_last_page_len
    )
