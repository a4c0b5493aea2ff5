"""On a CUDA device: our kernels against FlashInfer itself and against the references at serving shapes."""

import pytest
import torch

from pdkernels.decode_attention import decode_attention, decode_attention_ref
from pdkernels.extend_attention import extend_attention, extend_attention_ref
from pdkernels.kv_append import kv_append, kv_append_mla
from pdkernels.splitk_gemm import splitk_gemm, splitk_gemm_ref
from pdkernels.testing import append_positions, make_paged_cache

pytestmark = pytest.mark.gpu
SEQ_LENS = [1, 17, 50, 700, 2049]


def _cuda(case):
    for name in ("cache", "kv_indptr", "kv_indices", "kv_last_page_len"):
        setattr(case, name, getattr(case, name).cuda())
    return case


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_kv_append_equals_flashinfer(kv_layout, page_size):
    flashinfer = pytest.importorskip("flashinfer")
    case = _cuda(make_paged_cache(SEQ_LENS, 8, 128, page_size, kv_layout, dtype=torch.bfloat16))
    batch_indices, positions = (t.cuda() for t in append_positions(case, [1, 9, 50, 300, 1]))
    k = torch.randn(positions.numel(), 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
    ours, theirs = case.cache.clone(), case.cache.clone()
    kv_append(k, v, batch_indices, positions, ours, *tables, kv_layout)
    flashinfer.page.append_paged_kv_cache(
        k, v, batch_indices, positions, theirs, *tables, kv_layout=kv_layout
    )
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_kv_append_mla_equals_flashinfer():
    flashinfer = pytest.importorskip("flashinfer")
    case = _cuda(make_paged_cache(SEQ_LENS, 1, 1, 16))
    batch_indices, positions = (t.cuda() for t in append_positions(case, [1, 9, 50, 300, 1]))
    latent = torch.randn(case.cache.shape[0], 16, 576, device="cuda", dtype=torch.bfloat16)
    ours = latent.clone()
    ckv = torch.randn(positions.numel(), 512, device="cuda", dtype=torch.bfloat16)
    kpe = torch.randn(positions.numel(), 64, device="cuda", dtype=torch.bfloat16)
    tables = (case.kv_indices, case.kv_indptr, case.kv_last_page_len)
    kv_append_mla(ckv, kpe, batch_indices, positions, ours[..., :512], ours[..., 512:], *tables)
    # FlashInfer takes two contiguous caches; ours may be views of one [pages, P, 576] tensor
    ckv_c, kpe_c = latent[..., :512].contiguous(), latent[..., 512:].contiguous()
    flashinfer.page.append_paged_mla_kv_cache(ckv, kpe, batch_indices, positions, ckv_c, kpe_c, *tables)
    torch.testing.assert_close(ours, torch.cat([ckv_c, kpe_c], -1), atol=0, rtol=0)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_attention_close_to_flashinfer(group):
    pytest.importorskip("flashinfer")
    from pdkernels import flashinfer_ops

    case = _cuda(make_paged_cache(SEQ_LENS, 8, 128, 16, "HND", dtype=torch.bfloat16))
    q = torch.randn(len(SEQ_LENS), 8 * group, 128, device="cuda", dtype=torch.bfloat16)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, "HND")
    ours, lse = decode_attention(q, *tables, return_lse=True)
    theirs, their_lse = flashinfer_ops.decode_attention(q, *tables, return_lse=True)
    torch.testing.assert_close(ours, theirs, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(lse, their_lse, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(ours, decode_attention_ref(q, *tables), atol=1.6e-2, rtol=1.6e-2)


def test_extend_attention_close_to_ref_on_gpu():
    case = _cuda(make_paged_cache(SEQ_LENS, 8, 128, 16, "HND", dtype=torch.float16))
    q_lens = [1, 9, 50, 300, 1]
    qo_indptr = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.float16)
    tables = (case.cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len, "HND")
    torch.testing.assert_close(
        extend_attention(q, qo_indptr, *tables),
        extend_attention_ref(q, qo_indptr, *tables),
        atol=2e-3,
        rtol=2e-3,
    )


@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_splitk_gemm_close_to_ref_on_gpu(m):
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16) / 64
    torch.testing.assert_close(splitk_gemm(x, w), splitk_gemm_ref(x, w), atol=3e-2, rtol=1.6e-2)
