// Helpers shared by the CPU extension's files (pdkernels/cpu.py builds them into one module): element
// conversion to fp32, an exp that vectorizes and (AVX2) 8-lane sums and maxima. Inline, in pdk's namespace.
#pragma once

#include <torch/extension.h>
#include <ATen/record_function.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cstdint>

namespace pdk {

// f() in a profiler range named pdk::<name>, as pdkernels' profile_cpu names this extension's calls from
// Python (a call from C++ to C++ the profiler would not see; free when it is off)
template <typename F>
auto recorded(const char* name, F&& f) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  return f();
}

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

// exp(x) for x <= 0 (an online softmax's arguments) in plain arithmetic, so that loops of it vectorize:
// Cephes' expf (2^n times a degree-6 polynomial on [-ln2/2, ln2/2]), relative error about 1e-7; below
// -87 it returns exp(-87) ~ 1.6e-38 instead of underflowing (an -inf argument gives that, not 0).
// Its constants, shared by the 8- and 16-lane versions below: log2(e), ln 2 in two parts (Cody-Waite), and
// the polynomial's coefficients, highest degree first (the last two terms, r + 1, are added after them).
constexpr float kExpLog2e = 1.44269504088896341f, kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = (x * kExpLog2e + 12582912.0f) - 12582912.0f;  // rounded (1.5 * 2^23 trick)
  const float r = x - n * kExpLn2Hi - n * kExpLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

#if defined(__AVX2__) && defined(__FMA__)
// The sum and the maximum of v's 8 lanes, as trees (halves, then pairs, then the last two).
inline float hsum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

inline float hmax8(__m256 v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
}

// exp_nonpositive on 8 lanes (compilers left the scalar one's loops scalar where a loop also took a maximum
// or masked its tail).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Lo),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// exp_nonpositive on 16 lanes
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Lo),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 16 bf16 values as fp32, and back rounded to nearest even (as c10::BFloat16's conversion)
inline __m512 load_bf16_16(const c10::BFloat16* src) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store_bf16_16(c10::BFloat16* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512 round_bf16_16(__m512 v) {  // v rounded to bf16 and back
  const __m256i raw = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

}  // namespace pdk
