// CPU paths for the paged KV cache and the model's elementwise passes (pdkernels/cpu.py builds this at
// first use, with decode_cpu.cpp and linear_cpu.cpp): the KV append into 5-D HND caches [pages, 2 (K, V),
// kv_heads, page_size, head_dim], the residual add and RMSNorm, extend attention's gather and causal
// softmax, rope. Same math as pdkernels' torch references; fp32 arithmetic whatever the dtype.
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
#include <vector>

#include "simd_cpu.h"

using pdk::exp_nonpositive;
using pdk::to_float;

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
void add_rms_norm_row_scalar(T* x, const T* residual, const T* weight, T* out, int64_t dim, float eps,
                             float* row) {
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

template <typename T>  // the scalar row; in bf16 with AVX-512 BF16, 16 lanes at a time (below)
void add_rms_norm_row(T* x, const T* residual, const T* weight, T* out, int64_t dim, float eps, float* row) {
  add_rms_norm_row_scalar(x, residual, weight, out, dim, eps, row);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The same row in bf16, 16 lanes at a time (dim a multiple of 16): c10::BFloat16's conversions leave the
// loops above scalar.
template <>
void add_rms_norm_row(c10::BFloat16* x, const c10::BFloat16* residual, const c10::BFloat16* weight,
                      c10::BFloat16* out, int64_t dim, float eps, float* row) {
  if (dim % 16 != 0) return add_rms_norm_row_scalar(x, residual, weight, out, dim, eps, row);
  __m512 squares = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    __m512 v = pdk::load_bf16_16(x + d);
    if (residual != nullptr) {
      v = pdk::round_bf16_16(_mm512_add_ps(v, pdk::load_bf16_16(residual + d)));
      pdk::store_bf16_16(x + d, v);
    }
    _mm512_storeu_ps(row + d, v);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(dim) + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 normed = pdk::round_bf16_16(_mm512_mul_ps(_mm512_loadu_ps(row + d), scale));
    pdk::store_bf16_16(out + d, _mm512_mul_ps(normed, pdk::load_bf16_16(weight + d)));
  }
}
#endif

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

// One row of silu_mul: o = silu(g) * u, each product rounded to T as torch's two ops round it.
template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t width) {
  for (int64_t i = 0; i < width; ++i) {
    const float x = static_cast<float>(g[i]);
    const float s = static_cast<float>(static_cast<T>(x / (1.0f + std::exp(-x))));
    o[i] = static_cast<T>(s * static_cast<float>(u[i]));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// In bf16, 16 lanes at a time: silu(x) = x * sigmoid(x), sigmoid from e = exp(-|x|) (1 / (1 + e), or
// e / (1 + e) for x < 0), the tail as above
template <>
void silu_mul_row(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* o, int64_t width) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= width; i += 16) {
    const __m512 x = pdk::load_bf16_16(g + i);
    const __m512 e = pdk::exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 s = pdk::round_bf16_16(_mm512_mul_ps(x, _mm512_mask_mul_ps(r, neg, e, r)));
    pdk::store_bf16_16(o + i, _mm512_mul_ps(s, pdk::load_bf16_16(u + i)));
  }
  for (; i < width; ++i) {
    const float x = static_cast<float>(g[i]);
    const float s = static_cast<float>(static_cast<c10::BFloat16>(x / (1.0f + std::exp(-x))));
    o[i] = static_cast<c10::BFloat16>(s * static_cast<float>(u[i]));
  }
}
#endif

// gate_up [T, 2F] (gate, then up; a contiguous last dim) -> silu(gate) * up [T, F] in its dtype, in one pass
// (F.silu(gate) * up takes two passes and a temporary).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up: [T, 2F], a contiguous last dim");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, width}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t)
        silu_mul_row<scalar_t>(gp + t * stride, gp + t * stride + width, op + t * width, width);
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

// The index of each row's largest value, as torch.argmax(x, -1): the first of equal maxima, and a NaN counts as
// larger than any number (the first NaN's index). x [R, N] fp32, a contiguous last dim (any row stride).
// Two passes of AVX-512 where built with it (the max, then where it first is), where torch's reduction is
// scalar over a step's [batch, vocab] logits.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "x: [R, N > 0] fp32, a contiguous last dim");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = xp + r * stride;
      float top = row[0];
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 vmax = _mm512_set1_ps(row[0]);
      __mmask16 nan = 0;
      for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, v);
      }
      top = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(vmax);
#endif
      for (; i < n; ++i) top = (std::isnan(row[i]) || std::isnan(top)) ? std::numeric_limits<float>::quiet_NaN()
                                                                       : std::max(top, row[i]);
      int64_t at = 0;
      if (std::isnan(top)) {
        while (!std::isnan(row[at])) ++at;
      } else {
        i = 0;
#if defined(__AVX512F__)
        const __m512 want = _mm512_set1_ps(top);
        for (; i + 16 <= n; i += 16) {
          const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), want, _CMP_EQ_OQ);
          if (hit) break;
        }
#endif
        for (at = i; row[at] != top; ++at) {
        }
      }
      op[r] = at;
    }
  });
  return out;
}

// e4m3 (fn: no infinities; 0x7F and 0xFF NaN, as torch gives them: 0x7FF00000 with the sign) as fp32,
// exactly: a normal's exponent and mantissa moved into fp32's fields (bias 7 -> 127), a subnormal (exponent
// 0) m * 2^-9. torch's conversion ran a byte at a time (most of an e4m3 decode step: docs/results/fp8-kv.md).
inline float e4m3_to_float(uint8_t b) {
  const uint32_t mag = b & 0x7Fu, sign = (b & 0x80u) << 24;
  if (mag == 0x7Fu) return std::bit_cast<float>(0x7FF00000u | sign);
  const float value = mag < 8 ? static_cast<float>(mag) * 0x1p-9f : std::bit_cast<float>((mag << 20) + (120u << 23));
  return std::bit_cast<float>(std::bit_cast<uint32_t>(value) | sign);
}

#if defined(__AVX2__)
// e4m3_to_float on 8 bytes
inline __m256 e4m3_to_float8(const uint8_t* q) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
  const __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f)));
  __m256i v = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
  v = _mm256_blendv_epi8(v, _mm256_set1_epi32(0x7FF00000), _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(v, sign));
}
#endif

// n e4m3 values times scale, each rounded once into out's dtype (store_row: bf16 on the raw bits)
template <typename T>
inline void dequantize_row(const uint8_t* q, float scale, T* out, int64_t n) {
  float row[64];
  for (int64_t d0 = 0; d0 < n; d0 += 64) {
    const int64_t m = std::min<int64_t>(64, n - d0);
    int64_t d = 0;
#if defined(__AVX2__)
    for (; d + 8 <= m; d += 8)
      _mm256_storeu_ps(row + d, _mm256_mul_ps(e4m3_to_float8(q + d0 + d), _mm256_set1_ps(scale)));
#endif
    for (; d < m; ++d) row[d] = e4m3_to_float(q[d0 + d]) * scale;
    store_row(row, out + d0, m);
  }
}

// pdkernels.kv_quant.gather_pages' dequantizing copy: cache [pages, planes, ...] e4m3 with scales [pages,
// planes, H] fp32 (one per page, plane and head; HND: a head's P x D block, NHD: every D run of P x H rows
// cycles through the heads), the pages `pages` names -> [n, planes, ...] in dtype (fp32, bf16 or fp16), each
// element (q as fp32) * scale rounded once to dtype, as torch's (q.float() * scale).to(dtype).
torch::Tensor gather_dequantize(const torch::Tensor& cache, const torch::Tensor& scales, const torch::Tensor& pages,
                                bool hnd, at::ScalarType dtype) {
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.element_size() == 1,
              "cache must be a contiguous 5-D e4m3 (or uint8) paged cache");
  const int64_t planes = cache.size(1), heads = hnd ? cache.size(2) : cache.size(3), dim = cache.size(4);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == cache.size(0) && scales.size(1) == planes && scales.size(2) == heads,
              "scales must be [pages, planes, H] fp32 for this cache");
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.dim() == 1, "pages must be int64 [n]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "dtype: fp32, bf16 or fp16");
  const int64_t n = pages.size(0), count = cache.size(0), page = cache[0].numel(), plane = page / planes;
  auto sizes = cache.sizes().vec();
  sizes[0] = n;
  auto out = torch::empty(sizes, cache.options().dtype(dtype));
  const auto* src = reinterpret_cast<const uint8_t*>(cache.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const int64_t* ids = pages.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ids[i] >= 0 && ids[i] < count, "page ", ids[i], " out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "gather_dequantize", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, n * planes, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t j = lo; j < hi; ++j) {
        const int64_t i = j / planes, c = j % planes;
        const uint8_t* from = src + ids[i] * page + c * plane;
        const float* scale = sp + (ids[i] * planes + c) * heads;
        scalar_t* to = dst + j * plane;
        for (int64_t r = 0; r < plane / dim; ++r) {  // a row of D: one head's
          const float sc = scale[hnd ? r / (plane / dim / heads) : r % heads];
          dequantize_row(from + r * dim, sc, to + r * dim, dim);
        }
      }
    });
  });
  return out;
}

void register_decode(pybind11::module& m);  // decode_cpu.cpp
void register_linear(pybind11::module& m);  // linear_cpu.cpp
void register_extend(pybind11::module& m);  // extend_cpu.cpp
void register_layers(pybind11::module& m);  // layers_cpu.cpp
void register_attention_amx(pybind11::module& m);  // attention_amx.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode(m);
  register_linear(m);
  register_extend(m);
  register_layers(m);
  register_attention_amx(m);
  m.def("add_rms_norm", &add_rms_norm, "residual add and RMSNorm in one pass (CPU)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("kv_append", &kv_append, "append K and V rows to a 5-D HND paged cache (CPU)");
  m.def("gather_dequantize", &gather_dequantize, "e4m3 pages with their scales, dequantized into a compact "
        "cache (CPU)", py::arg("cache"), py::arg("scales"), py::arg("pages"), py::arg("hnd"), py::arg("dtype"));
  m.def("gather_kv", &gather_kv, "one sequence's K and V from its pages, [2, Hkv, L, D] (CPU)");
  m.def("causal_softmax", &causal_softmax, "scaled softmax of a causal block of scores (CPU)");
  m.def("rope", &rope, "rotary embedding, half-split layout (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2F] gate_up (CPU)");
  m.def("argmax_rows", &argmax_rows, "each row's argmax, as torch.argmax(x, -1) (CPU, fp32)");
}
