// CPU paths for the paged KV cache (pdkernels/cpu.py builds this at first use): decode attention that
// reads each sequence's pages where they lie, and the KV append, for 5-D HND caches
// [pages, 2 (K, V), kv_heads, page_size, head_dim]. Same math as pdkernels.decode_attention's and
// pdkernels.kv_append's references; fp32 arithmetic whatever the cache's dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bf16 is the top half of an fp32: a shift, on the raw bits (c10::BFloat16's conversion does not vectorize)
template <>
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(bits[i]) << 16);
}

// a . b; the lanes summed as a tree (a loop's in-order sum of its lanes would cost a chain of adds)
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// exp(x) for x <= 0 (an online softmax's arguments) in plain arithmetic, so that loops of it vectorize:
// Cephes' expf (2^n times a degree-6 polynomial on [-ln2/2, ln2/2]), relative error about 1e-7; below
// -87 it returns exp(-87) ~ 1.6e-38 instead of underflowing (an -inf argument gives that, not 0).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // rounded (1.5 * 2^23 trick)
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// One online-softmax step over a chunk of one query head's n scores s (turned into their probabilities
// against the new running maximum m; l, the running sum, updated). Returns alpha, the factor that
// rescales what was accumulated before the chunk (~0 at the first chunk: m = -inf, l = 0).
inline float online_softmax_step(float* s, int64_t n, float& m, float& l) {
  const float top = std::max(m, *std::max_element(s, s + n));
  const float alpha = exp_nonpositive(m - top);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_nonpositive(s[t] - top);
    sum += s[t];
  }
  l = l * alpha + sum;
  m = top;
  return alpha;
}

// Each query head's output [heads, dim] divided by its softmax sum (a sequence with no token: zeros).
inline void normalize_heads(float* out, const float* l, int64_t heads, int64_t dim) {
  for (int64_t g = 0; g < heads; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] *= inv;
  }
}

// One sequence: its query heads attend over its pages, a page at a time. A page is one block [K|V, kv
// heads, tokens, dim] and is read front to back (every kv head's K, then V) while the next page is
// prefetched: pages lie anywhere in the cache, so the hardware prefetcher alone stalls at each one.
// Per page and query head: the scores of the page's tokens, then one online-softmax rescale.
template <typename T>
void attend(const float* q, const T* cache, const int32_t* pages, int64_t num_pages, int64_t last_len,
            int64_t heads, int64_t kv_heads, int64_t page_size, int64_t dim, float scale, float* out,
            std::vector<float>& work) {
  const int64_t group = heads / kv_heads;
  work.assign(dim + heads * page_size + 2 * heads, 0.0f);
  float* row = work.data();
  float* s = row + dim;  // [heads, page_size]
  float* m = s + heads * page_size;
  float* l = m + heads;
  std::fill(m, m + heads, -std::numeric_limits<float>::infinity());
  std::fill(out, out + heads * dim, 0.0f);
  const int64_t block = 2 * kv_heads * page_size * dim;  // elements of one page
  for (int64_t pi = 0; pi < num_pages; ++pi) {
    const int64_t tokens = pi + 1 == num_pages ? last_len : page_size;
    const T* k = cache + pages[pi] * block;
    const T* v = k + kv_heads * page_size * dim;
    if (pi + 1 < num_pages) {
      const char* next = reinterpret_cast<const char*>(cache + pages[pi + 1] * block);
      for (int64_t byte = 0; byte < block * static_cast<int64_t>(sizeof(T)); byte += 64)
        __builtin_prefetch(next + byte);
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* kh = k + h * page_size * dim;
      for (int64_t t = 0; t < tokens; ++t) {
        to_float(kh + t * dim, row, dim);
        for (int64_t g = h * group; g < (h + 1) * group; ++g)
          s[g * page_size + t] = dot(q + g * dim, row, dim) * scale;
      }
    }
    for (int64_t g = 0; g < heads; ++g) {
      const float alpha = online_softmax_step(s + g * page_size, tokens, m[g], l[g]);
      float* og = out + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) og[d] *= alpha;
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* vh = v + h * page_size * dim;
      for (int64_t t = 0; t < tokens; ++t) {
        to_float(vh + t * dim, row, dim);
        for (int64_t g = h * group; g < (h + 1) * group; ++g) {
          const float p = s[g * page_size + t];
          float* og = out + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) og[d] += p * row[d];
        }
      }
    }
  }
  normalize_heads(out, l, heads, dim);
}

#if defined(__AVX512BF16__)
// Lane i of the result: the sum of v[i]'s 16 lanes (16 dot products' partial sums reduced at once, where
// one _mm512_reduce_add_ps per dot product cost more than the dot product itself).
inline __m512 transpose_sum16(const __m512* v) {
  __m512 w[8], z[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], a = v[2i], b = v[2i+1]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: element e holds that lane's sum of v[4i + e]
    const __m512d x = _mm512_castps_pd(w[2 * i]), y = _mm512_castps_pd(w[2 * i + 1]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // the 128-bit lanes summed: element 4j + e = the whole sum of v[4j + e]
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x88), _mm512_shuffle_f32x4(z[2], z[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// The scores (unscaled) of up to 16 consecutive K rows of one head against one query head q (dim / 32 bf16
// pairs), lane t for row t; lanes from n on are not meaningful. CH = dim / 32 when fixed at compile time
// (0: at run time), so that the 16 dot products unroll and stay in registers.
template <int CH>
inline __m512 scores16(const __m512bh* q, const c10::BFloat16* k, int64_t dim, int64_t n) {
  const int64_t chunks = CH > 0 ? CH : dim / 32;
  __m512 acc[16];
  if (n == 16) {
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int64_t c = 0; c < chunks; ++c)
        a = _mm512_dpbf16_ps(a, q[c], (__m512bh)_mm512_loadu_si512(k + t * dim + 32 * c));
      acc[t] = a;
    }
  } else {  // the last rows of a sequence: nothing past them is read (it may lie past the cache's end)
    for (int t = 0; t < 16; ++t) {
      acc[t] = _mm512_setzero_ps();
      if (t < n)
        for (int64_t c = 0; c < chunks; ++c)
          acc[t] = _mm512_dpbf16_ps(acc[t], q[c], (__m512bh)_mm512_loadu_si512(k + t * dim + 32 * c));
    }
  }
  return transpose_sum16(acc);
}

// 16 bf16 -> 16 fp32 (a widening shift)
inline __m512 load_bf16x16(const c10::BFloat16* src) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// attend's math for a bf16 cache on CPUs with AVX-512 BF16 (dim a multiple of 32): the scores of 16 tokens
// at a time in bf16 pairs (vdpbf16ps; q rounded to bf16, exact for a bf16 model's q) with the 16 dot
// products' lanes reduced together, one online-softmax step per 16 tokens, and P V in fp32 with each
// query head's output accumulated in registers over the 16 tokens (attend's per-token update of the
// output in memory waited on its own previous store).
template <int CH>
void attend_bf16(const float* q, const c10::BFloat16* cache, const int32_t* pages, int64_t num_pages,
                 int64_t last_len, int64_t heads, int64_t kv_heads, int64_t page_size, int64_t dim, float scale,
                 float* out, std::vector<float>& work) {
  const int64_t group = heads / kv_heads, chunks = dim / 32;
  std::vector<__m512bh> qv(heads * chunks);
  for (int64_t g = 0; g < heads; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      qv[g * chunks + c] =
          _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * dim + 32 * c + 16), _mm512_loadu_ps(q + g * dim + 32 * c));
  work.assign(heads * 16 + 3 * heads, 0.0f);
  float* p = work.data();  // [heads, 16]: one chunk's scores, then its probabilities
  float* m = p + heads * 16;
  float* l = m + heads;
  float* alpha = l + heads;
  std::fill(m, m + heads, -std::numeric_limits<float>::infinity());
  std::fill(out, out + heads * dim, 0.0f);
  const int64_t block = 2 * kv_heads * page_size * dim;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t pi = 0; pi < num_pages; ++pi) {
    const int64_t tokens = pi + 1 == num_pages ? last_len : page_size;
    const c10::BFloat16* k = cache + pages[pi] * block;
    const c10::BFloat16* v = k + kv_heads * page_size * dim;
    const c10::BFloat16* next = pi + 1 < num_pages ? cache + pages[pi + 1] * block : nullptr;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const c10::BFloat16* kh = k + h * page_size * dim;
      const c10::BFloat16* vh = v + h * page_size * dim;
      if (next != nullptr)  // the next page's rows of this head, spread over the heads' work
        for (int64_t kv = 0; kv < 2; ++kv) {
          const char* rows = reinterpret_cast<const char*>(next + (kv * kv_heads + h) * page_size * dim);
          for (int64_t byte = 0; byte < page_size * dim * 2; byte += 64) __builtin_prefetch(rows + byte);
        }
      for (int64_t t0 = 0; t0 < tokens; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, tokens - t0);
        for (int64_t g = h * group; g < (h + 1) * group; ++g) {
          float* pg = p + g * 16;
          _mm512_storeu_ps(pg, _mm512_mul_ps(scores16<CH>(qv.data() + g * chunks, kh + t0 * dim, dim, n), vscale));
          alpha[g] = online_softmax_step(pg, n, m[g], l[g]);
        }
        for (int64_t g = h * group; g < (h + 1) * group; ++g) {
          float* og = out + g * dim;
          const float* pg = p + g * 16;
          const __m512 a = _mm512_set1_ps(alpha[g]);
          for (int64_t d = 0; d < dim; d += 64) {  // four independent accumulators (dim: a multiple of 32)
            const bool wide = d + 64 <= dim;
            __m512 o0 = _mm512_mul_ps(_mm512_loadu_ps(og + d), a);
            __m512 o1 = _mm512_mul_ps(_mm512_loadu_ps(og + d + 16), a);
            __m512 o2 = wide ? _mm512_mul_ps(_mm512_loadu_ps(og + d + 32), a) : _mm512_setzero_ps();
            __m512 o3 = wide ? _mm512_mul_ps(_mm512_loadu_ps(og + d + 48), a) : _mm512_setzero_ps();
            for (int64_t t = 0; t < n; ++t) {
              const __m512 pt = _mm512_set1_ps(pg[t]);
              const c10::BFloat16* row = vh + (t0 + t) * dim + d;
              o0 = _mm512_fmadd_ps(pt, load_bf16x16(row), o0);
              o1 = _mm512_fmadd_ps(pt, load_bf16x16(row + 16), o1);
              if (wide) {
                o2 = _mm512_fmadd_ps(pt, load_bf16x16(row + 32), o2);
                o3 = _mm512_fmadd_ps(pt, load_bf16x16(row + 48), o3);
              }
            }
            _mm512_storeu_ps(og + d, o0);
            _mm512_storeu_ps(og + d + 16, o1);
            if (wide) {
              _mm512_storeu_ps(og + d + 32, o2);
              _mm512_storeu_ps(og + d + 48, o3);
            }
          }
        }
      }
    }
  }
  normalize_heads(out, l, heads, dim);
}
#endif

}  // namespace

// q [B, Hq, D] fp32 contiguous; cache [pages, 2, Hkv, P, D] contiguous; kv_indptr [B + 1], kv_indices,
// kv_last_page_len [B] int32. Returns [B, Hq, D] fp32.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor kv_indptr,
                               torch::Tensor kv_indices, torch::Tensor kv_last_page_len, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q: [B, Hq, D] fp32");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(1) == 2, "cache: 5-D HND");
  for (const auto& t : {kv_indptr, kv_indices, kv_last_page_len})
    TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), "page table: int32, contiguous");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = cache.size(2), page_size = cache.size(3);
  TORCH_CHECK(cache.size(4) == dim && heads % kv_heads == 0, "q and cache disagree");
  auto out = torch::empty_like(q);
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "decode_attention", [&] {
    const scalar_t* cp = cache.data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> work;
      for (int64_t b = lo; b < hi; ++b) {
        const int64_t n = indptr[b + 1] - indptr[b];
#if defined(__AVX512BF16__)
        if (std::is_same_v<scalar_t, c10::BFloat16> && dim % 32 == 0) {
          const auto* bf = reinterpret_cast<const c10::BFloat16*>(cp);
          auto* run = dim == 64 ? &attend_bf16<2> : dim == 128 ? &attend_bf16<4> : &attend_bf16<0>;
          run(qp + b * heads * dim, bf, indices + indptr[b], n, n ? last[b] : 0, heads, kv_heads, page_size, dim,
              static_cast<float>(scale), op + b * heads * dim, work);
          continue;
        }
#endif
        attend<scalar_t>(qp + b * heads * dim, cp, indices + indptr[b], n, n ? last[b] : 0, heads, kv_heads,
                         page_size, dim, static_cast<float>(scale), op + b * heads * dim, work);
      }
    });
  });
  return out;
}

// k, v [T, Hkv, D] (any strides but a contiguous last dim) into their (page, entry) slots.
void kv_append(torch::Tensor k, torch::Tensor v, torch::Tensor batch_indices, torch::Tensor positions,
               torch::Tensor cache, torch::Tensor kv_indices, torch::Tensor kv_indptr) {
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(1) == 2, "cache: 5-D HND");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(), "dtypes");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k, v: contiguous last dim");
  for (const auto& t : {batch_indices, positions, kv_indices, kv_indptr})
    TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), "indices: int32, contiguous");
  const int64_t tokens = k.size(0), kv_heads = cache.size(2), page_size = cache.size(3), dim = cache.size(4);
  TORCH_CHECK(k.size(1) == kv_heads && k.size(2) == dim && v.sizes() == k.sizes(), "k, v: [T, Hkv, D]");
  const int32_t* b = batch_indices.data_ptr<int32_t>();
  const int32_t* pos = positions.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "kv_append", [&] {
    scalar_t* cp = cache.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t page = indices[indptr[b[t]] + pos[t] / page_size], entry = pos[t] % page_size;
      scalar_t* dst = cp + page * 2 * kv_heads * page_size * dim + entry * dim;
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::copy_n(kp + t * k.stride(0) + h * k.stride(1), dim, dst + h * page_size * dim);
        std::copy_n(vp + t * v.stride(0) + h * v.stride(1), dim, dst + (kv_heads + h) * page_size * dim);
      }
    }
  });
}

// One row of add_rms_norm: x += residual (when given, rounded to the dtype as torch's add), then
// out = (x * rsqrt(mean(x^2) + eps)).to(dtype) * weight. A function of its own: pragmas cannot sit
// inside the dispatch macro's argument.
template <typename T>
void add_rms_norm_row(T* x, const T* residual, const T* weight, T* out, int64_t dim, float eps, float* row) {
  if (residual != nullptr)
    for (int64_t d = 0; d < dim; ++d)
      x[d] = static_cast<T>(static_cast<float>(x[d]) + static_cast<float>(residual[d]));
  to_float(x, row, dim);
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t d = 0; d < dim; ++d) squares += row[d] * row[d];
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
  for (int64_t d = 0; d < dim; ++d)  // rounded to the dtype, then times the weight (the model's order)
    out[d] = static_cast<T>(static_cast<float>(static_cast<T>(row[d] * inv)) * static_cast<float>(weight[d]));
}

// x [T, D] contiguous (the residual stream, updated in place), residual [T, D] (or none), weight [D], all of
// one dtype: x += residual, then returns rms_norm(x) * weight: the model's residual add and RMSNorm in one
// pass over each row (as torch ops they were five calls and passes).
torch::Tensor add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
                           double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: [T, D] contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), "weight: [D]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x: one dtype");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous(), "residual: [T, D] contiguous");
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), "residual and x: one dtype");
  }
  const int64_t rows = x.size(0), dim = x.size(1);
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> row(dim);
      for (int64_t t = lo; t < hi; ++t)
        add_rms_norm_row<scalar_t>(xp + t * dim, rp ? rp + t * dim : nullptr, wp, op + t * dim, dim,
                                   static_cast<float>(eps), row.data());
    });
  });
  return out;
}

// The first seq_len tokens of one sequence's pages [n] of a 5-D HND cache, as kv [2 (K, V), Hkv, seq_len, D]
// contiguous: each page's row of a head is one block copy (torch's index_select and the transpose after
// it were two passes, and slow ones on the CPU).
torch::Tensor gather_kv(torch::Tensor cache, torch::Tensor pages, int64_t seq_len) {
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(1) == 2, "cache: 5-D HND");
  TORCH_CHECK(pages.scalar_type() == at::kInt && pages.dim() == 1 && pages.is_contiguous(), "pages: int32 [n]");
  const int64_t kv_heads = cache.size(2), page_size = cache.size(3), dim = cache.size(4), n = pages.size(0);
  TORCH_CHECK(seq_len >= 0 && seq_len <= n * page_size, "seq_len: at most the pages' tokens");
  auto out = torch::empty({2, kv_heads, seq_len, dim}, cache.options());
  const int32_t* pp = pages.data_ptr<int32_t>();
  const int64_t num_pages = cache.size(0);
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < num_pages, "page id out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "gather_kv", [&] {
    const scalar_t* cp = cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i * page_size < seq_len; ++i) {
      const int64_t tokens = std::min(page_size, seq_len - i * page_size);
      const scalar_t* page = cp + pp[i] * 2 * kv_heads * page_size * dim;
      for (int64_t row = 0; row < 2 * kv_heads; ++row)  // K's heads, then V's
        std::copy_n(page + row * page_size * dim, tokens * dim, op + (row * seq_len + i * page_size) * dim);
    }
  });
  return out;
}

// float -> bf16 rounded to nearest even on the raw bits (as c10::BFloat16 rounds; finite inputs), so that
// loops of it vectorize
inline uint16_t bf16_bits(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <>
inline void store_row(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = bf16_bits(src[i]);
}

// max of x[0..n): omp simd's max reduction stayed a serial chain here (5x slower than the rest of a
// softmax row), so the lanes are explicit
inline float row_max(const float* x, int64_t n) {
  constexpr float lowest = -std::numeric_limits<float>::infinity();
  float top = lowest;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(lowest);
  for (; j + 16 <= n; j += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(x + j));
  top = _mm512_reduce_max_ps(acc);
#else
  float lanes[8] = {lowest, lowest, lowest, lowest, lowest, lowest, lowest, lowest};
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = lanes[l] > x[j + l] ? lanes[l] : x[j + l];
  top = *std::max_element(lanes, lanes + 8);
#endif
  for (; j < n; ++j) top = std::max(top, x[j]);
  return top;
}

// One row of causal_softmax: the first `keep` of its n scores times scale, softmax over them in fp32,
// zeros after.
template <typename T>
void softmax_row(const T* s, T* out, int64_t n, int64_t keep, float scale, float* row) {
  to_float(s, row, keep);
#pragma omp simd
  for (int64_t j = 0; j < keep; ++j) row[j] *= scale;
  const float top = row_max(row, keep);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < keep; ++j) {
    row[j] = exp_nonpositive(row[j] - top);
    sum += row[j];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < keep; ++j) row[j] *= inv;
  std::fill(row + keep, row + n, 0.0f);
  store_row(row, out, n);
}

// scores [M, rows, n] (the GEMM's Q K^T for `rows` consecutive query positions, the last of which sees
// all n keys): row r keeps its first n - rows + r + 1 keys (causal), times scale, softmax in fp32, the
// probabilities in the scores' dtype, masked keys 0. What blocked_causal_attention's mask, cast, scale and
// torch.softmax did in five passes (torch's exp alone ran at about 0.7 ns an element here).
torch::Tensor causal_softmax(torch::Tensor scores, double scale) {
  TORCH_CHECK(scores.dim() == 3 && scores.is_contiguous(), "scores: [M, rows, n] contiguous");
  const int64_t m = scores.size(0), rows = scores.size(1), n = scores.size(2);
  TORCH_CHECK(rows <= n, "scores: rows at most n (the last row sees every key)");
  auto out = torch::empty_like(scores);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "causal_softmax", [&] {
    const scalar_t* sp = scores.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, m * rows, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> row(n);
      for (int64_t i = lo; i < hi; ++i)
        softmax_row<scalar_t>(sp + i * n, op + i * n, n, n - rows + i % rows + 1, static_cast<float>(scale),
                              row.data());
    });
  });
  return out;
}

// One token's heads of rope: x1 * cos - x2 * sin, x2 * cos + x1 * sin on the two halves of each head, in
// fp32, each product rounded before the sum as torch computes it (no fused multiply-add: fp32 results
// bit-identical to the torch code, which fp32 greedy parity with transformers rests on).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_token(const T* x, int64_t stride_h, T* out,
                                                             int64_t heads, int64_t half, const float* c,
                                                             const float* s, float* row) {
  for (int64_t h = 0; h < heads; ++h) {
    to_float(x + h * stride_h, row, 2 * half);
    float* o = row + 2 * half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = row[i] * c[i], b = row[i + half] * s[i];
      const float e = row[i + half] * c[i], f = row[i] * s[i];
      o[i] = a - b;
      o[i + half] = e + f;
    }
    store_row(o, out + h * 2 * half, 2 * half);
  }
}

// x [T, H, D] (a contiguous last dim, any other strides), cos and sin [T, D / 2] fp32 contiguous: rotary
// embedding in Hugging Face's half-split layout, a new contiguous [T, H, D] in x's dtype (pdkernels.rope's
// rope_ref; as torch ops it was nine calls and their temporaries per layer).
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x: [T, H, D], D even, last dim contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  for (const auto& t : {cos, sin})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == tokens * half,
                "cos, sin: [T, D / 2] fp32 contiguous");
  auto out = torch::empty({tokens, heads, 2 * half}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    at::parallel_for(0, tokens, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> row(4 * half);
      for (int64_t t = lo; t < hi; ++t)
        rope_token<scalar_t>(xp + t * x.stride(0), x.stride(1), op + t * heads * 2 * half, heads, half,
                             cp + t * half, sp + t * half, row.data());
    });
  });
  return out;
}

void register_linear(pybind11::module& m);  // linear_cpu.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_linear(m);
  m.def("add_rms_norm", &add_rms_norm, "residual add and RMSNorm in one pass (CPU)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("decode_attention", &decode_attention, "paged decode attention over a 5-D HND cache (CPU)");
  m.def("kv_append", &kv_append, "append K and V rows to a 5-D HND paged cache (CPU)");
  m.def("gather_kv", &gather_kv, "one sequence's K and V from its pages, [2, Hkv, L, D] (CPU)");
  m.def("causal_softmax", &causal_softmax, "scaled softmax of a causal block of scores (CPU)");
  m.def("rope", &rope, "rotary embedding, half-split layout (CPU)");
}
