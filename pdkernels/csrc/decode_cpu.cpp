// Paged decode attention on the CPU (pdkernels/cpu.py builds it with paged_cpu.cpp): each sequence's query
// heads attend over its K/V pages where they lie in a 5-D HND cache [pages, 2 (K, V), kv_heads, page_size,
// head_dim], one online-softmax step per chunk of tokens, threads over sequences. pdkernels.decode_attention's
// reference math, fp32 arithmetic whatever the cache's dtype. Three loops, picked by the CPU it was built
// for and the cache: AVX-512 BF16 for bf16 caches, AVX2 + FMA for fp32 and bf16 ones, a portable one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd_cpu.h"

namespace {

using pdk::exp_nonpositive;
using pdk::to_float;

// a . b; the lanes summed as a tree (a loop's in-order sum of its lanes would cost a chain of adds)
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  sum = pdk::hsum8(acc);
#endif
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
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

#if defined(__AVX2__) && defined(__FMA__)
// online_softmax_step on one step of 16 scores, of which the first n (1..16) are tokens', in 8-lane vectors
// (the lanes from n on come out 0). The scalar loop's maximum was a chain of dependent compares, and its
// exp ran a lane at a time: a third of a 924-token decode's time, its KV in cache, on an AVX2 EPYC.
inline float online_softmax_step16(float* s, int64_t n, float& m, float& l) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 in0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
  const __m256 in1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n) - 8), lanes));
  const __m256 none = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 s0 = _mm256_blendv_ps(none, _mm256_loadu_ps(s), in0);
  const __m256 s1 = _mm256_blendv_ps(none, _mm256_loadu_ps(s + 8), in1);
  const float top = std::max(m, pdk::hmax8(_mm256_max_ps(s0, s1)));
  const float alpha = exp_nonpositive(m - top);
  const __m256 shift = _mm256_set1_ps(top);
  const __m256 e0 = _mm256_and_ps(pdk::exp_nonpositive8(_mm256_sub_ps(s0, shift)), in0);
  const __m256 e1 = _mm256_and_ps(pdk::exp_nonpositive8(_mm256_sub_ps(s1, shift)), in1);
  _mm256_storeu_ps(s, e0);
  _mm256_storeu_ps(s + 8, e1);
  l = l * alpha + pdk::hsum8(_mm256_add_ps(e0, e1));
  m = top;
  return alpha;
}
#else
inline float online_softmax_step16(float* s, int64_t n, float& m, float& l) { return online_softmax_step(s, n, m, l); }
#endif

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

// The walk both vector paths share, in steps of 16 tokens: one sequence's pages front to back, the next page
// prefetched meanwhile; per kv head and step, the scaled scores of the head's group of query heads
// (scores(g0, k, n, p): head g0 + i's in p[16 i ..][0..n), for the n rows from k on), then per query head
// one online-softmax step, and the group's outputs rescaled and given the step's P V (pv(o, p, alpha, v, n):
// head i's output o + i * dim, scaled by alpha[i], accumulated in registers over the n rows from v on with
// its probabilities p + 16 i).
template <typename T, typename Scores, typename PV>
inline void attend_steps(const T* cache, const int32_t* pages, int64_t num_pages, int64_t last_len, int64_t heads,
                         int64_t kv_heads, int64_t page_size, int64_t dim, float* out, std::vector<float>& work,
                         Scores&& scores, PV&& pv) {
  const int64_t group = heads / kv_heads;
  work.assign(heads * 16 + 3 * heads, 0.0f);
  float* p = work.data();  // [heads, 16]: one step's scores, then its probabilities
  float* m = p + heads * 16;
  float* l = m + heads;
  float* alpha = l + heads;
  std::fill(m, m + heads, -std::numeric_limits<float>::infinity());
  std::fill(out, out + heads * dim, 0.0f);
  const int64_t block = 2 * kv_heads * page_size * dim;
  for (int64_t pi = 0; pi < num_pages; ++pi) {
    const int64_t tokens = pi + 1 == num_pages ? last_len : page_size;
    const T* k = cache + pages[pi] * block;
    const T* v = k + kv_heads * page_size * dim;
    // the next page's lines, a share before each query head's softmax step: prefetched into L2 (one burst
    // of a head's 128 lines at its start stalled the core on its full miss buffers: a quarter of its time)
    const char* next = pi + 1 < num_pages ? reinterpret_cast<const char*>(cache + pages[pi + 1] * block) : nullptr;
    const int64_t lines = block * static_cast<int64_t>(sizeof(T)) / 64;
    const int64_t slots = kv_heads * ((tokens + 15) / 16) * group;
    int64_t slot = 0;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* kh = k + h * page_size * dim;
      const T* vh = v + h * page_size * dim;
      for (int64_t t0 = 0; t0 < tokens; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, tokens - t0);
        scores(h * group, kh + t0 * dim, n, p + h * group * 16);
        for (int64_t g = h * group; g < (h + 1) * group; ++g, ++slot) {
          if (next != nullptr)
            for (int64_t line = slot * lines / slots; line < (slot + 1) * lines / slots; ++line)
              __builtin_prefetch(next + 64 * line, 0, 2);
          alpha[g] = online_softmax_step16(p + g * 16, n, m[g], l[g]);
        }
        pv(out + h * group * dim, p + h * group * 16, alpha + h * group, vh + t0 * dim, n);
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

// The scaled scores of NG query heads (q: their CH bf16 chunk pairs each, head after head) against 16 whole
// K rows, into p[g * 16 + t]: 8 rows at a time, each row's chunk loaded once and multiplied into the NG
// heads' accumulators, then per head the 16 sums reduced together. Each head's sums in scores16's order
// (per row: the chunks in turn from zero), so the same bits.
template <int NG, int CH>
[[gnu::always_inline]] inline void scores16_heads_bf16(const __m512bh* q, const c10::BFloat16* k, int64_t dim,
                                                       float* p, __m512 scale) {
  __m512 sums[NG][16];
  for (int r = 0; r < 16; r += 8) {
    __m512 acc[NG][8];
#pragma GCC unroll 3
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) acc[g][t] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < CH; ++c)
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m512bh kt = (__m512bh)_mm512_loadu_si512(k + (r + t) * dim + 32 * c);
#pragma GCC unroll 3
        for (int g = 0; g < NG; ++g) acc[g][t] = _mm512_dpbf16_ps(acc[g][t], q[g * CH + c], kt);
      }
    for (int g = 0; g < NG; ++g)
      for (int t = 0; t < 8; ++t) sums[g][r + t] = acc[g][t];
  }
  for (int g = 0; g < NG; ++g) _mm512_storeu_ps(p + g * 16, _mm512_mul_ps(transpose_sum16(sums[g]), scale));
}

// P V of NG query heads at head dim 64 over the n rows from v on: each V row widened to fp32 once for the NG
// heads, each head's output (o + 64 g, scaled by alpha[g]) in four registers. Each head's products in the
// per-head loop's order (per lane: rescaled, then row after row), so the same bits.
template <int NG>
[[gnu::always_inline]] inline void pv64_heads_bf16(float* o, const float* p, const float* alpha,
                                                   const c10::BFloat16* v, int64_t n) {
  __m512 acc[NG][4];
#pragma GCC unroll 3
  for (int g = 0; g < NG; ++g) {
    const __m512 a = _mm512_set1_ps(alpha[g]);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(o + g * 64 + 16 * c), a);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 row[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) row[c] = load_bf16x16(v + t * 64 + 16 * c);
#pragma GCC unroll 3
    for (int g = 0; g < NG; ++g) {
      const __m512 pt = _mm512_set1_ps(p[g * 16 + t]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(pt, row[c], acc[g][c]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + g * 64 + 16 * c, acc[g][c]);
}

// attend's math for a bf16 cache on CPUs with AVX-512 BF16 (dim a multiple of 32): the scores of 16 tokens
// at a time in bf16 pairs (vdpbf16ps; q rounded to bf16, exact for a bf16 model's q) with the 16 dot
// products' lanes reduced together, one online-softmax step per 16 tokens, and P V in fp32 with each
// query head's output accumulated in registers over the 16 tokens (attend's per-token update of the
// output in memory waited on its own previous store). At a whole step of 16 rows each K row is read once
// for up to three query heads of its group, and at head dim 64 each V row widened once for them (head by
// head, a group of 3 read and widened every row three times).
template <int CH>
void attend_bf16(const float* q, const c10::BFloat16* cache, const int32_t* pages, int64_t num_pages,
                 int64_t last_len, int64_t heads, int64_t kv_heads, int64_t page_size, int64_t dim, float scale,
                 float* out, std::vector<float>& work) {
  const int64_t chunks = dim / 32;
  std::vector<__m512bh> qv(heads * chunks);
  for (int64_t g = 0; g < heads; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      qv[g * chunks + c] =
          _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * dim + 32 * c + 16), _mm512_loadu_ps(q + g * dim + 32 * c));
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t group = heads / kv_heads;
  auto scores = [&](int64_t g0, const c10::BFloat16* k, int64_t n, float* p) {
    int64_t g = 0;
    if constexpr (CH > 0) {
      if (n == 16) {  // a whole step
        const __m512bh* qg = qv.data() + g0 * chunks;
        for (; g + 3 <= group; g += 3) scores16_heads_bf16<3, CH>(qg + g * chunks, k, dim, p + g * 16, vscale);
        if (group - g == 2) scores16_heads_bf16<2, CH>(qg + g * chunks, k, dim, p + g * 16, vscale);
        if (group - g == 1) scores16_heads_bf16<1, CH>(qg + g * chunks, k, dim, p + g * 16, vscale);
        return;
      }
    }
    for (; g < group; ++g)
      _mm512_storeu_ps(p + g * 16, _mm512_mul_ps(scores16<CH>(qv.data() + (g0 + g) * chunks, k, dim, n), vscale));
  };
  auto pv_head = [&](float* og, const float* pg, float alpha, const c10::BFloat16* v, int64_t n) {
    const __m512 a = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < dim; d += 64) {  // four independent accumulators (dim: a multiple of 32)
      const bool wide = d + 64 <= dim;
      __m512 o0 = _mm512_mul_ps(_mm512_loadu_ps(og + d), a);
      __m512 o1 = _mm512_mul_ps(_mm512_loadu_ps(og + d + 16), a);
      __m512 o2 = wide ? _mm512_mul_ps(_mm512_loadu_ps(og + d + 32), a) : _mm512_setzero_ps();
      __m512 o3 = wide ? _mm512_mul_ps(_mm512_loadu_ps(og + d + 48), a) : _mm512_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        const __m512 pt = _mm512_set1_ps(pg[t]);
        const c10::BFloat16* row = v + t * dim + d;
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
  };
  auto pv = [&](float* o, const float* p, const float* alpha, const c10::BFloat16* v, int64_t n) {
    int64_t g = 0;
    if constexpr (CH == 2) {  // head dim 64
      for (; g + 3 <= group; g += 3) pv64_heads_bf16<3>(o + g * 64, p + g * 16, alpha + g, v, n);
      if (group - g == 2) pv64_heads_bf16<2>(o + g * 64, p + g * 16, alpha + g, v, n);
      if (group - g == 1) pv64_heads_bf16<1>(o + g * 64, p + g * 16, alpha + g, v, n);
      return;
    }
    for (; g < group; ++g) pv_head(o + g * dim, p + g * 16, alpha[g], v, n);
  };
  attend_steps(cache, pages, num_pages, last_len, heads, kv_heads, page_size, dim, out, work, scores, pv);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 fp32 from 8 cache elements: fp32 as they are, bf16 widened (a shift of the raw bits)
inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load8(const c10::BFloat16* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Lane i of the result: the sum of v[i]'s 8 lanes (8 dot products' partial sums reduced at once,
// where one horizontal sum each cost about as much as the dot product)
inline __m256 transpose_sum8(const __m256* v) {
  // per 128-bit half: [sum of v[4j + e]'s lanes 0-3 (low half) or 4-7 (high half)], e = 0..3
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// The scores (unscaled) of up to 8 consecutive K rows against one query head q (dim / 8 fp32 vectors),
// lane t for row t, 0 from n on (nothing past row n is read: it may lie past the cache's end). CH = dim / 8
// when fixed at compile time (0: at run time), so that the dot products unroll and stay in registers.
template <int CH, typename T>
[[gnu::always_inline]] inline __m256 scores8(const __m256* q, const T* k, int64_t dim, int64_t n) {
  const int64_t chunks = CH > 0 ? CH : dim / 8;
  __m256 acc[8];
  if (n == 8) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m256 a = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int64_t c = 0; c < chunks; ++c) a = _mm256_fmadd_ps(q[c], load8(k + t * dim + 8 * c), a);
      acc[t] = a;
    }
  } else {
    for (int t = 0; t < 8; ++t) {
      acc[t] = _mm256_setzero_ps();
      if (t < n)
        for (int64_t c = 0; c < chunks; ++c) acc[t] = _mm256_fmadd_ps(q[c], load8(k + t * dim + 8 * c), acc[t]);
    }
  }
  return transpose_sum8(acc);
}

// The scaled scores of NG query heads (q: their dim / 8 vectors each, head after head) against 16 whole K rows,
// into p[g * 16 + t]: the rows four at a time, each row's chunk loaded once and multiplied into the NG heads'
// accumulators (NG x 4 of them; scores8 per head read every row once a head, and its eight single-head
// accumulators lived on the stack), then per head the 16 sums reduced eight at a time.
template <int NG, int CH, typename T>
[[gnu::always_inline]] inline void scores16_heads(const __m256* q, const T* k, int64_t dim, float* p, __m256 scale) {
  const int64_t chunks = CH > 0 ? CH : dim / 8;
  __m256 sums[NG][16];
  for (int r = 0; r < 16; r += 4) {
    __m256 acc[NG][4];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g)
      for (int t = 0; t < 4; ++t) acc[g][t] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int64_t c = 0; c < chunks; ++c) {
      __m256 kt[4];
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) kt[t] = load8(k + (r + t) * dim + 8 * c);
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g)
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) acc[g][t] = _mm256_fmadd_ps(q[g * chunks + c], kt[t], acc[g][t]);
    }
    for (int g = 0; g < NG; ++g)
      for (int t = 0; t < 4; ++t) sums[g][r + t] = acc[g][t];
  }
  for (int g = 0; g < NG; ++g) {
    _mm256_storeu_ps(p + g * 16, _mm256_mul_ps(transpose_sum8(sums[g]), scale));
    _mm256_storeu_ps(p + g * 16 + 8, _mm256_mul_ps(transpose_sum8(sums[g] + 8), scale));
  }
}

// attend's math with AVX2 and FMA for fp32 and bf16 caches (dim a multiple of 32): attend_bf16's shape in
// 8-lane vectors, q kept in fp32: the scores of 16 tokens a step (two transposed sums of 8), one
// online-softmax step per 16 tokens, P V with each query head's output accumulated in registers. The
// portable loop's dot products summed their 64 lanes in order, one dependent add after another (the
// compiler may not reorder fp32 sums), and updated the output in memory after every token.
template <int CH, typename T>
void attend_avx2(const float* q, const T* cache, const int32_t* pages, int64_t num_pages, int64_t last_len,
                 int64_t heads, int64_t kv_heads, int64_t page_size, int64_t dim, float scale, float* out,
                 std::vector<float>& work) {
  const int64_t chunks = dim / 8;
  std::vector<__m256> qv(heads * chunks);
  for (int64_t g = 0; g < heads; ++g)
    for (int64_t c = 0; c < chunks; ++c) qv[g * chunks + c] = _mm256_loadu_ps(q + g * dim + 8 * c);
  const __m256 vscale = _mm256_set1_ps(scale);
  const int64_t group = heads / kv_heads;
  auto scores = [&](int64_t g0, const T* k, int64_t n, float* p) {
    int64_t g = 0;
    if (n == 16) {  // a whole step: each K row read once for up to three query heads at a time
      for (; g + 3 <= group; g += 3) scores16_heads<3, CH>(qv.data() + (g0 + g) * chunks, k, dim, p + g * 16, vscale);
      if (group - g == 2) scores16_heads<2, CH>(qv.data() + (g0 + g) * chunks, k, dim, p + g * 16, vscale);
      if (group - g == 1) scores16_heads<1, CH>(qv.data() + (g0 + g) * chunks, k, dim, p + g * 16, vscale);
      return;
    }
    for (; g < group; ++g) {
      const __m256* qg = qv.data() + (g0 + g) * chunks;
      float* pg = p + g * 16;
      _mm256_storeu_ps(pg, _mm256_mul_ps(scores8<CH>(qg, k, dim, std::min<int64_t>(n, 8)), vscale));
      if (n > 8) _mm256_storeu_ps(pg + 8, _mm256_mul_ps(scores8<CH>(qg, k + 8 * dim, dim, n - 8), vscale));
    }
  };
  auto pv_head = [&](float* og, const float* pg, float alpha, const T* v, int64_t n) {
    const __m256 a = _mm256_set1_ps(alpha);
    if constexpr (CH == 8) {  // dim 64: the whole row in eight accumulators (four waited on the FMA's latency)
      __m256 o[8];
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(og + 8 * c), a);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 pt = _mm256_set1_ps(pg[t]);
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) o[c] = _mm256_fmadd_ps(pt, load8(v + t * dim + 8 * c), o[c]);
      }
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(og + 8 * c, o[c]);
      return;
    }
    for (int64_t d = 0; d < dim; d += 32) {  // four independent accumulators (dim: a multiple of 32)
      __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(og + d), a);
      __m256 o1 = _mm256_mul_ps(_mm256_loadu_ps(og + d + 8), a);
      __m256 o2 = _mm256_mul_ps(_mm256_loadu_ps(og + d + 16), a);
      __m256 o3 = _mm256_mul_ps(_mm256_loadu_ps(og + d + 24), a);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 pt = _mm256_set1_ps(pg[t]);
        const T* row = v + t * dim + d;
        o0 = _mm256_fmadd_ps(pt, load8(row), o0);
        o1 = _mm256_fmadd_ps(pt, load8(row + 8), o1);
        o2 = _mm256_fmadd_ps(pt, load8(row + 16), o2);
        o3 = _mm256_fmadd_ps(pt, load8(row + 24), o3);
      }
      _mm256_storeu_ps(og + d, o0);
      _mm256_storeu_ps(og + d + 8, o1);
      _mm256_storeu_ps(og + d + 16, o2);
      _mm256_storeu_ps(og + d + 24, o3);
    }
  };
  auto pv = [&](float* o, const float* p, const float* alpha, const T* v, int64_t n) {
    for (int64_t g = 0; g < group; ++g) pv_head(o + g * dim, p + g * 16, alpha[g], v, n);
  };
  attend_steps(cache, pages, num_pages, last_len, heads, kv_heads, page_size, dim, out, work, scores, pv);
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
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
          if (dim % 32 == 0) {
            auto* run = dim == 64    ? &attend_avx2<8, scalar_t>
                        : dim == 128 ? &attend_avx2<16, scalar_t>
                                     : &attend_avx2<0, scalar_t>;
            run(qp + b * heads * dim, cp, indices + indptr[b], n, n ? last[b] : 0, heads, kv_heads, page_size,
                dim, static_cast<float>(scale), op + b * heads * dim, work);
            continue;
          }
        }
#endif
        attend<scalar_t>(qp + b * heads * dim, cp, indices + indptr[b], n, n ? last[b] : 0, heads, kv_heads,
                         page_size, dim, static_cast<float>(scale), op + b * heads * dim, work);
      }
    });
  });
  return out;
}

void register_decode(pybind11::module& m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over a 5-D HND cache (CPU)");
}
