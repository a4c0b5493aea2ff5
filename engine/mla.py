"""DeepSeek's multi-head latent attention over the paged cache (engine.config.MLAConfig).

A token's KV is one latent row [c | k_pe]: c = RMSNorm(x W_DKV) (kv_lora_rank wide) and k_pe, a RoPE'd
key shared by every head, so the cache holds one row per token (no heads) and every TP rank holds the same
rows. Head h's key is [c W_UK[h] | k_pe] and its value c W_UV[h] (W_UK, W_UV: kv_b_proj's two halves).

- Decode attends in the absorbed form (DeepSeek-V2 paper, FlashMLA, vLLM's MLA backends): q_nope W_UK[h]^T
  is the query against the latent rows, so each step reads the rows as they lie, all heads sharing them
  (pdkernels.ops.mla_decode_attention), and W_UV is applied to the attention-weighted latent afterwards.
- Prefill and extend decompress: each chunk's context rows become per-head keys and values, then the
  ordinary paged extend attention runs over them (compute-bound, it wants the smaller head dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.config import ModelConfig
from pdkernels import kv_quant, ops


def load_attention(weights: dict[str, Tensor], prefix: str, config: ModelConfig, h0: int, h1: int) -> dict:
    """A layer's MLA tensors for query heads [h0, h1), from the checkpoint's names under prefix
    (`...self_attn.`): the latent projection whole (replicated), the heads' slices of the rest. A
    checkpoint whose RoPE rotates adjacent pairs (rope_interleave) gets its rope rows reordered to halves,
    which rotate the same pairs (q and k alike, so scores are unchanged)."""
    m = config.mla
    qk, r, dr = m.qk_head_dim, m.kv_lora_rank, m.qk_rope_head_dim
    pairs = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)]) if config.rope_interleave else None

    def w(name):
        return weights[prefix + name + ".weight"]

    def q_rows(q: Tensor) -> Tensor:  # [heads x qk, in] -> this rank's heads, rope rows halved
        q = q.view(-1, qk, q.shape[-1])[h0:h1]
        if pairs is not None:
            q = torch.cat([q[:, : m.qk_nope_head_dim], q[:, m.qk_nope_head_dim :][:, pairs]], dim=1)
        return q.reshape(-1, q.shape[-1])

    kv_a = w("kv_a_proj_with_mqa")
    if pairs is not None:
        kv_a = torch.cat([kv_a[:r], kv_a[r:][pairs]])
    kv_b = w("kv_b_proj").view(-1, m.qk_nope_head_dim + m.v_head_dim, r)[h0:h1]
    layer = {
        "kv_a": kv_a,
        "kv_a_norm": w("kv_a_layernorm"),
        "w_uk": kv_b[:, : m.qk_nope_head_dim].contiguous(),  # [h, nope, r]
        "w_uv": kv_b[:, m.qk_nope_head_dim :].contiguous(),  # [h, v, r]
        "o": w("o_proj")[:, h0 * m.v_head_dim : h1 * m.v_head_dim],
    }
    if m.q_lora_rank is None:
        layer["q_proj"] = q_rows(w("q_proj"))
    else:
        layer.update(q_a=w("q_a_proj"), q_a_norm=w("q_a_layernorm"), q_b=q_rows(w("q_b_proj")))
    return layer


def latent_caches(layer_cache: Tensor, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Views [pages, P, kv_lora_rank] and [pages, P, rope] of one layer's [pages, 1, 1, P, row] cache."""
    rows = layer_cache[:, 0, 0]
    return rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]


def project(model, layer: dict, x: Tensor, rope: tuple) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [T, hidden] -> q_nope [T, h, nope], q_pe [T, h, rope] (RoPE'd), and the tokens' latent row:
    c [T, kv_lora_rank] (RMS-normed) and k_pe [T, rope] (RoPE'd)."""
    m, t, r = model.config.mla, x.shape[0], model.config.mla.kv_lora_rank
    if "q_proj" in layer:
        q = model.linear(x, layer["q_proj"])
    else:
        q = model.linear(model.rms_norm(model.linear(x, layer["q_a"]), layer["q_a_norm"]), layer["q_b"])
    q_nope, q_pe = q.view(t, -1, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
    latent = model.linear(x, layer["kv_a"])  # [T, r + rope]
    ckv = model.rms_norm(latent[:, :r], layer["kv_a_norm"])
    return q_nope, model.rope(q_pe, *rope), ckv, model.rope(latent[:, None, r:], *rope)[:, 0]


def attention(
    model, layer: dict, x: Tensor, meta, layer_cache: Tensor, rope: tuple, scales: Tensor | None = None
) -> Tensor:
    """x [T, hidden] -> this rank's heads' attention output [T, heads x v_head_dim] (before o_proj);
    appends the tokens' latent rows to layer_cache. An e4m3 cache (scales: its [pages, 1, 1], a scale per
    page of latent rows) is quantized as written and its pages dequantized to be read, as a K/V one is."""
    m, t = model.config.mla, x.shape[0]
    r = m.kv_lora_rank
    q_nope, q_pe, ckv, kpe = project(model, layer, x, rope)
    indices = meta.kv_indices
    if scales is not None:  # one plane of one head: its layout is either (the same bytes)
        rows = torch.cat([ckv, kpe], dim=-1)[:, None]
        kv_quant.append_pages(
            rows, None, meta.batch_indices, meta.positions, layer_cache, scales, indices, meta.kv_indptr
        )
        layer_cache, indices = kv_quant.gather_pages(layer_cache, scales, indices, "HND", x.dtype)
        ckv_cache, kpe_cache = latent_caches(layer_cache, r)
    else:
        ckv_cache, kpe_cache = latent_caches(layer_cache, r)
        tables = (indices, meta.kv_indptr, meta.kv_last_page_len)
        ops.kv_append_mla(
            ckv, kpe, meta.batch_indices, meta.positions, ckv_cache, kpe_cache, *tables, validate=False
        )
    if meta.all_decode:
        q_lat = torch.bmm(q_nope.transpose(0, 1), layer["w_uk"]).transpose(0, 1)  # [T, h, r]
        o_lat = ops.mla_decode_attention(
            q_lat,
            q_pe,
            ckv_cache,
            kpe_cache,
            meta.kv_indptr,
            indices,
            meta.kv_last_page_len,
            sm_scale=m.scale,
            max_seq_len=meta.max_kv_len,
            validate=False,
        )
        o = torch.bmm(o_lat.transpose(0, 1), layer["w_uv"].transpose(1, 2))  # [h, T, v]
        return o.transpose(0, 1).reshape(t, -1)
    keys_values = decompress(layer, ckv_cache, kpe_cache, indices, m.qk_nope_head_dim)
    dim = keys_values.shape[-1]
    q = F.pad(torch.cat([q_nope, q_pe], dim=-1), (0, dim - m.qk_head_dim))
    o = ops.extend_attention(
        q.contiguous(),
        meta.qo_indptr,
        keys_values,
        meta.kv_indptr,
        torch.arange(len(meta.kv_indices), dtype=meta.kv_indices.dtype, device=x.device),
        meta.kv_last_page_len,
        sm_scale=m.scale,
        max_q_len=meta.max_q_len,
        validate=False,
    )
    return o[..., : m.v_head_dim].reshape(t, -1)


def decompress(layer: dict, ckv_cache: Tensor, kpe_cache: Tensor, pages: Tensor, nope: int) -> Tensor:
    """The listed pages' per-head keys and values as an HND paged cache [len(pages), 2, h, P, D] whose page
    i is pages[i] (K = [c W_UK | k_pe], V = c W_UV, both zero-padded to D = max(nope + rope, v))."""
    w_uk, w_uv = layer["w_uk"], layer["w_uv"]
    heads, v_dim = w_uv.shape[:2]
    ckv, kpe = ckv_cache[pages.long()], kpe_cache[pages.long()]  # [n, P, r], [n, P, rope]
    n, page_size = ckv.shape[:2]
    dim = max(nope + kpe.shape[-1], v_dim)
    out = ckv.new_zeros(n, 2, heads, page_size, dim)
    flat = ckv.reshape(1, n * page_size, -1)
    out[:, 0, :, :, :nope] = (
        torch.matmul(flat, w_uk.transpose(1, 2)).view(heads, n, page_size, nope).transpose(0, 1)
    )
    out[:, 0, :, :, nope : nope + kpe.shape[-1]] = kpe[:, None]
    out[:, 1, :, :, :v_dim] = (
        torch.matmul(flat, w_uv.transpose(1, 2)).view(heads, n, page_size, v_dim).transpose(0, 1)
    )
    return out
