// Paged extend (prefill) attention on the CPU with AVX2 + FMA (pdkernels/cpu.py builds it with paged_cpu.cpp):
// each request's new queries attend causally over its pages, a flash-style online softmax over blocks of
// keys, fp32 arithmetic whatever the cache's dtype. pdkernels.extend_attention's reference math.
//
// Per request and kv head, the head's keys are laid out once as K^T [dim, L] and its values as V [L, dim],
// both fp32 and contiguous (the pages lie anywhere in the cache, the GEMM-shaped loops below want rows and
// columns at fixed strides). A query block is BQ positions x the head's group of query heads, so one load of
// a key or value serves every query head that shares it (GQA). Per block of 64 keys: the block's scores by
// a broadcast-and-FMA kernel (6 query rows x 16 keys in 12 registers), the causal mask and one online-softmax
// step per query row, then P V (6 query rows x 16 dims in 12 registers). Threads split a request's (kv head,
// query block) pairs round-robin: later blocks see more keys, so contiguous ranges would not balance.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd_cpu.h"

namespace {

using pdk::exp_nonpositive;
using pdk::to_float;

constexpr int64_t kKeyBlock = 64;  // keys per online-softmax step
constexpr int64_t kTile = 16;      // keys per score tile (two registers)
constexpr int64_t kRowsTarget = 48;  // query rows (positions x group heads) per query block

// One request's kv head, laid out for the kernels: kt [dim, stride] (keys as columns, zero past L), v [L, dim].
struct HeadKV {
  const float* kt;
  const float* v;
  int64_t stride;
};

// s[r, 0..16 * tiles) = q_r . k_t for MR rows of q (each dim long, rows ld apart) and the keys from t0 on.
template <int MR>
inline void scores_rows(const float* q, int64_t ld, const HeadKV& kv, int64_t dim, int64_t t0, int64_t tiles,
                        float* s, int64_t ls) {
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const float* kcol = kv.kt + t0 + tile * kTile;
    __m256 acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m256 k0 = _mm256_loadu_ps(kcol + d * kv.stride), k1 = _mm256_loadu_ps(kcol + d * kv.stride + 8);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m256 qi = _mm256_broadcast_ss(q + i * ld + d);
        acc[i][0] = _mm256_fmadd_ps(qi, k0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(qi, k1, acc[i][1]);
      }
    }
    for (int i = 0; i < MR; ++i) {
      _mm256_storeu_ps(s + i * ls + tile * kTile, acc[i][0]);
      _mm256_storeu_ps(s + i * ls + tile * kTile + 8, acc[i][1]);
    }
  }
}

// o_r = o_r * alpha_r + sum_t p[r, t] v_t for MR rows, n keys from v on, 16 dims at a time: 12 accumulators,
// the two registers of v_t and one broadcast fit the 16 registers (at 32 dims and 3 rows the compiler re-read
// v_t from memory at every FMA, and the loop waited on loads).
template <int MR>
inline void pv_rows(float* o, const float* p, int64_t ls, const float* alpha, const float* v, int64_t n,
                    int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) {
    __m256 acc[MR][2];
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(alpha + i);
      acc[i][0] = _mm256_mul_ps(a, _mm256_loadu_ps(o + i * dim + d));
      acc[i][1] = _mm256_mul_ps(a, _mm256_loadu_ps(o + i * dim + d + 8));
    }
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v0 = _mm256_loadu_ps(v + t * dim + d), v1 = _mm256_loadu_ps(v + t * dim + d + 8);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m256 pt = _mm256_broadcast_ss(p + i * ls + t);
        acc[i][0] = _mm256_fmadd_ps(pt, v0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(pt, v1, acc[i][1]);
      }
    }
    for (int i = 0; i < MR; ++i) {
      _mm256_storeu_ps(o + i * dim + d, acc[i][0]);
      _mm256_storeu_ps(o + i * dim + d + 8, acc[i][1]);
    }
  }
}

// f(MR, r) over rows [0, rows) in groups of 6 (the kernels' register blocks), MR a compile-time constant.
template <typename F>
inline void in_sixes(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) f(std::integral_constant<int, 6>{}, r);
  switch (rows - r) {
    case 5: f(std::integral_constant<int, 5>{}, r); break;
    case 4: f(std::integral_constant<int, 4>{}, r); break;
    case 3: f(std::integral_constant<int, 3>{}, r); break;
    case 2: f(std::integral_constant<int, 2>{}, r); break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// Lanes t >= n of a step of 8 from t0: the tail of a row of scores.
inline __m256 tail_mask(int64_t n, int64_t t0) {
  return _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - t0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// max(s[0..n)), n >= 1 (s has room for whole steps of 8).
inline float row_max(const float* s, int64_t n) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n; t += 8)
    top = _mm256_max_ps(top, _mm256_blendv_ps(top, _mm256_loadu_ps(s + t), tail_mask(n, t)));
  return pdk::hmax8(top);
}

// s[t] = exp(s[t] - top) for t < n, 0 from n to width (a multiple of 8 or the block's end); their sum.
inline float exp_row(float* s, int64_t n, float top, int64_t width) {
  __m256 sum = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  int64_t t = 0;
  for (; t < n; t += 8) {
    const __m256 e = _mm256_and_ps(pdk::exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift)),
                                   tail_mask(n, t));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  std::fill(s + t, s + std::max(t, width), 0.0f);
  return pdk::hsum8(sum);
}

// The work buffers of one query block: its rows scaled [R, dim], scores [R, kKeyBlock], output [R, dim],
// and per row the running maximum, sum and this step's rescale.
struct Block {
  std::vector<float> q, s, o, m, l, alpha;
  void reset(int64_t rows, int64_t dim) {
    q.assign(rows * dim, 0.0f);
    s.assign(rows * kKeyBlock, 0.0f);
    o.assign(rows * dim, 0.0f);
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.0f);
    alpha.assign(rows, 1.0f);
  }
};

// One query block: positions [i0, i1) of the request's new tokens (absolute position ctx + i), query heads
// [h * group, (h + 1) * group). q [n, heads, dim] is the request's queries, out likewise.
void attend_block(const float* q, float* out, const HeadKV& kv, int64_t ctx, int64_t i0, int64_t i1, int64_t h,
                  int64_t heads, int64_t group, int64_t dim, float scale, Block& b) {
  const int64_t rows = (i1 - i0) * group;  // row r: position i0 + r / group, query head h * group + r % group
  b.reset(rows, dim);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + ((i0 + r / group) * heads + h * group + r % group) * dim;
    for (int64_t d = 0; d < dim; ++d) b.q[r * dim + d] = src[d] * scale;
  }
  const int64_t keys = ctx + i1;  // the last row sees keys [0, ctx + i1)
  const float* qs = b.q.data();
  float* sc = b.s.data();
  for (int64_t k0 = 0; k0 < keys; k0 += kKeyBlock) {
    const int64_t k1 = std::min(keys, k0 + kKeyBlock);
    const int64_t tiles = (k1 - k0 + kTile - 1) / kTile;
    in_sixes(rows, [&](auto mr, int64_t r) {
      scores_rows<decltype(mr)::value>(qs + r * dim, dim, kv, dim, k0, tiles, sc + r * kKeyBlock, kKeyBlock);
    });
    for (int64_t r = 0; r < rows; ++r) {  // the causal mask and one online-softmax step per row
      float* s = sc + r * kKeyBlock;
      const int64_t valid = std::min(k1, ctx + i0 + r / group + 1) - k0;  // keys this row sees in the block
      if (valid <= 0) {
        std::fill(s, s + (k1 - k0), 0.0f);
        b.alpha[r] = 1.0f;
        continue;
      }
      const float top = std::max(b.m[r], row_max(s, valid));
      const float sum = exp_row(s, valid, top, k1 - k0);
      b.alpha[r] = exp_nonpositive(b.m[r] - top);  // ~0 at the first step: o and l are 0 then
      b.l[r] = b.l[r] * b.alpha[r] + sum;
      b.m[r] = top;
    }
    const float* v = kv.v + k0 * dim;
    in_sixes(rows, [&](auto mr, int64_t r) {
      pv_rows<decltype(mr)::value>(b.o.data() + r * dim, sc + r * kKeyBlock, kKeyBlock, b.alpha.data() + r, v, k1 - k0,
                                   dim);
    });
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((i0 + r / group) * heads + h * group + r % group) * dim;
    const float inv = 1.0f / b.l[r];  // every row sees at least key 0
    for (int64_t d = 0; d < dim; ++d) dst[d] = b.o[r * dim + d] * inv;
  }
}

// One request's kv heads from its pages into kt [kv_heads, dim, stride] and v [kv_heads, L, dim], fp32.
template <typename T>
void lay_out(const T* cache, const int32_t* pages, int64_t len, int64_t kv_heads, int64_t page_size, int64_t dim,
             int64_t stride, float* kt, float* v) {
  const int64_t block = 2 * kv_heads * page_size * dim;
  at::parallel_for(0, kv_heads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(dim);
    for (int64_t h = lo; h < hi; ++h) {
      float* kth = kt + h * dim * stride;
      std::fill(kth, kth + dim * stride, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const T* k = cache + pages[t / page_size] * block + (h * page_size + t % page_size) * dim;
        to_float(k, row.data(), dim);
        for (int64_t d = 0; d < dim; ++d) kth[d * stride + t] = row[d];
        to_float(k + kv_heads * page_size * dim, v + (h * len + t) * dim, dim);
      }
    }
  });
}

}  // namespace

// q [Q, Hq, D] fp32 contiguous, the new tokens of every request in order (request b's are rows
// [qo_indptr[b], qo_indptr[b + 1]), the last of its kv length); cache [pages, 2, Hkv, P, D] contiguous;
// qo_indptr, kv_indptr [B + 1], kv_indices, kv_last_page_len [B] int32. D a multiple of 32. Returns [Q, Hq, D].
torch::Tensor extend_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor qo_indptr, torch::Tensor kv_indptr,
                               torch::Tensor kv_indices, torch::Tensor kv_last_page_len, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q: [Q, Hq, D] fp32");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(1) == 2, "cache: 5-D HND");
  for (const auto& t : {qo_indptr, kv_indptr, kv_indices, kv_last_page_len})
    TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), "indptrs and page table: int32, contiguous");
  const int64_t heads = q.size(1), dim = q.size(2), batch = kv_last_page_len.size(0);
  const int64_t kv_heads = cache.size(2), page_size = cache.size(3);
  TORCH_CHECK(cache.size(4) == dim && heads % kv_heads == 0 && dim % 32 == 0, "q and cache disagree, or D % 32");
  TORCH_CHECK(qo_indptr.size(0) == batch + 1 && kv_indptr.size(0) == batch + 1, "indptrs: [B + 1]");
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  TORCH_CHECK(qo[0] == 0 && qo[batch] == q.size(0), "qo_indptr: from 0 to the number of queries");
  TORCH_CHECK(indptr[0] == 0 && indptr[batch] <= kv_indices.size(0), "kv_indptr: from 0 to at most the pages");
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(qo[b] <= qo[b + 1] && indptr[b] <= indptr[b + 1], "qo_indptr and kv_indptr: non-decreasing");
    TORCH_CHECK(indptr[b] == indptr[b + 1] || (last[b] >= 1 && last[b] <= page_size),
                "kv_last_page_len: 1 to the page size");
  }
  for (int64_t i = 0; i < indptr[batch]; ++i)
    TORCH_CHECK(indices[i] >= 0 && indices[i] < cache.size(0), "page id out of range: ", indices[i]);
  auto out = torch::zeros_like(q);
  const int64_t group = heads / kv_heads;
  const int64_t bq = std::max<int64_t>(1, (kRowsTarget + group - 1) / group);  // positions per query block
  std::vector<float> kt, v;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = qo[b + 1] - qo[b], num_pages = indptr[b + 1] - indptr[b];
    const int64_t len = num_pages > 0 ? (num_pages - 1) * page_size + last[b] : 0;
    if (n == 0 || len == 0) continue;
    TORCH_CHECK(n <= len && len <= num_pages * page_size, "request ", b, ": more queries than keys, or pages");
    // whole tiles, and 16 more columns: at a stride of a power of two (4 KiB for 1,024 keys) every row of a
    // tile's column would fall in one cache set
    const int64_t stride = (len + kTile - 1) / kTile * kTile + kTile;
    kt.resize(kv_heads * dim * stride);
    v.resize(kv_heads * len * dim);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "extend_attention", [&] {
      lay_out(cache.data_ptr<scalar_t>(), indices + indptr[b], len, kv_heads, page_size, dim, stride, kt.data(),
              v.data());
    });
    const int64_t blocks = (n + bq - 1) / bq, items = kv_heads * blocks, ctx = len - n;
    const float* qb = q.data_ptr<float>() + qo[b] * heads * dim;
    float* ob = out.data_ptr<float>() + qo[b] * heads * dim;
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
    at::parallel_for(0, workers, 1, [&](int64_t lo, int64_t hi) {
      Block work;
      for (int64_t w = lo; w < hi; ++w)
        for (int64_t item = w; item < items; item += workers) {
          const int64_t h = item % kv_heads, j = item / kv_heads;
          const HeadKV kv{kt.data() + h * dim * stride, v.data() + h * len * dim, stride};
          attend_block(qb, ob, kv, ctx, j * bq, std::min(n, (j + 1) * bq), h, heads, group, dim,
                       static_cast<float>(scale), work);
        }
    });
  }
  return out;
}

void register_extend(pybind11::module& m) {
  m.def("extend_attention", &extend_attention, "paged causal extend attention over a 5-D HND cache (CPU, AVX2)");
}

#else
void register_extend(pybind11::module& m) { (void)m; }
#endif
