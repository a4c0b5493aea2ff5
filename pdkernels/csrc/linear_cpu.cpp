// Linear layers on weights stored as int8 blocks (pdkernels/cpu.py, Q8Weight): per 32 weights of a row an
// fp32 scale and offset, w = q * scale + offset, which holds GGUF's Q8_0 (offset 0, q in [-127, 127]) and
// Q4_1 (offset its min, q in [0, 15]) exactly. A weight is stored so only where that is exact
// (q8_quantize_exact), i.e. where the model's fp32 weights were dequantized from such a file: y is then the
// fp32 product up to the summation order, while a decode step streams 1.25 bytes a weight instead of 4.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd_cpu.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

namespace {

constexpr int64_t kBlock = 32;  // Q8_0's block: one scale per 32 weights of a row

// One weight: q * scale + offset rounded once (q * scale is exact: q has at most 8 bits, the scale an fp16's
// 11), the value a Q8_0 or Q4_1 file dequantizes to.
inline float weight(int8_t q, float scale, float offset) { return std::fmaf(static_cast<float>(q), scale, offset); }

// Rows [n0, n1) of y[m, n] = sum_k x[m, k] * w[n, k], for M rows of x at a time: each block of weights is
// converted once and serves the M rows, whose 32-lane fp32 sums stay in registers.
template <int M>
void q8_rows(const float* x, int64_t ldx, const int8_t* q, const float* s, const float* o, float* y,
             int64_t ldy, int64_t n0, int64_t n1, int64_t K) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qr = q + n * K;
    const float* sr = s + n * nb;
    const float* orow = o + n * nb;
    float acc[M][kBlock];
    for (int m = 0; m < M; ++m)
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) acc[m][j] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      float w[kBlock];
      const float scale = sr[b], offset = orow[b];
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) w[j] = weight(qr[b * kBlock + j], scale, offset);
      for (int m = 0; m < M; ++m) {
        const float* xr = x + m * ldx + b * kBlock;
#pragma omp simd
        for (int j = 0; j < kBlock; ++j) acc[m][j] += w[j] * xr[j];
      }
    }
    for (int m = 0; m < M; ++m) {
      float t = 0.f;
#pragma omp simd reduction(+ : t)
      for (int j = 0; j < kBlock; ++j) t += acc[m][j];
      y[m * ldy + n] = t;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 weights of a block in fp32: q sign-extended from 8 bytes, q * scale + offset rounded once (weight())
inline __m256 weights8(const int8_t* q, __m256 scale, __m256 offset) {
  const __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), scale, offset);
}

// Rows [n0, n1) of y = w x for one row of x (a batch-1 decode step) with AVX2: 8 weight rows at a time,
// each block's 32 x values held in registers for the 8, one 8-lane sum per row reduced together at the end
// (pdk::transpose_sum8). q8_rows<1> spent about as long on each row's final horizontal sum and on zeroing
// and spilling its 32 sums as on the row's 18 blocks (K = 576).
void q8_row1(const float* x, const int8_t* q, const float* s, const float* o, float* y, int64_t n0, int64_t n1,
             int64_t K) {
  const int64_t nb = K / kBlock;
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) {
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    const char* next = reinterpret_cast<const char*>(q + (n + 8) * K);  // the next 8 rows, 8 x 32 bytes a block
    for (int64_t b = 0; b < nb; ++b) {
      if (n + 16 <= n1)
        for (int64_t line = 0; line < 8 * kBlock; line += 64) __builtin_prefetch(next + 8 * b * kBlock + line);
      const float* xb = x + b * kBlock;
      const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
      const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) {
        const int8_t* qb = q + (n + r) * K + b * kBlock;
        const __m256 scale = _mm256_broadcast_ss(s + (n + r) * nb + b);
        const __m256 offset = _mm256_broadcast_ss(o + (n + r) * nb + b);
        __m256 a = _mm256_fmadd_ps(weights8(qb, scale, offset), x0, acc[r]);
        a = _mm256_fmadd_ps(weights8(qb + 8, scale, offset), x1, a);
        a = _mm256_fmadd_ps(weights8(qb + 16, scale, offset), x2, a);
        acc[r] = _mm256_fmadd_ps(weights8(qb + 24, scale, offset), x3, a);
      }
    }
    _mm256_storeu_ps(y + n, pdk::transpose_sum8(acc));
  }
  if (n < n1) q8_rows<1>(x, K, q, s, o, y, 0, n, n1, K);
}
#endif

// x [M, K] fp32 (rows contiguous) @ w^T -> [M, N], w given as q [N, K] int8 and scales, offsets [N, K / 32]
// fp32; threads over output columns (every thread streams its own rows of the weight).
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                        const torch::Tensor& offsets) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [M, K] fp32 rows");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "q must be [N, K] int8");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && K % kBlock == 0, "q must be [N, K] with K = x's and a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * K / kBlock,
              "scales must be [N, K / 32] fp32");
  TORCH_CHECK(offsets.scalar_type() == at::kFloat && offsets.is_contiguous() && offsets.numel() == scales.numel(),
              "offsets must be [N, K / 32] fp32");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
#if defined(__AVX2__) && defined(__FMA__)
  if (M == 1) {
    at::parallel_for(0, N, 64, [&](int64_t lo, int64_t hi) { q8_row1(xp, qp, sp, op, yp, lo, hi, K); });
    return y;
  }
#endif
  at::parallel_for(0, N, 64, [&](int64_t lo, int64_t hi) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) q8_rows<4>(xp + m * ldx, ldx, qp, sp, op, yp + m * N, N, lo, hi, K);
    for (; m + 2 <= M; m += 2) q8_rows<2>(xp + m * ldx, ldx, qp, sp, op, yp + m * N, N, lo, hi, K);
    for (; m < M; ++m) q8_rows<1>(xp + m * ldx, ldx, qp, sp, op, yp + m * N, N, lo, hi, K);
  });
  return y;
}

// Whether the block's 32 weights are q * scale + offset (weight()) for some q in [lo, hi]: q fills qb.
bool fits(const float* blk, float scale, float offset, float lo, float hi, int8_t* qb) {
  const float inv = scale == 0.f ? 0.f : 1.f / scale;  // a candidate q; weight() decides
  bool ok = true;
#pragma omp simd reduction(&& : ok)
  for (int j = 0; j < kBlock; ++j) {
    const float v = std::fmin(std::fmax(std::rint((blk[j] - offset) * inv), lo), hi);
    qb[j] = static_cast<int8_t>(v);
    ok = ok && std::fmaf(v, scale, offset) == blk[j];
  }
  return ok;
}

// One block as Q8_0 (offset 0, the scale its largest |w| / 127) or as Q4_1 (offset its min, the scale an
// fp16 near (max - min) / 15, the few nearest tried: the max was rounded when it was dequantized).
bool quantize_block(const float* blk, float* scale, float* offset, int8_t* qb) {
  float amax = 0.f, lo = blk[0], hi = blk[0];
  for (int j = 0; j < kBlock; ++j) {
    amax = std::fmax(amax, std::fabs(blk[j]));
    lo = std::fmin(lo, blk[j]);
    hi = std::fmax(hi, blk[j]);
  }
  *offset = 0.f;
  *scale = amax / 127.f;
  if (static_cast<float>(c10::Half(*scale)) == *scale && fits(blk, *scale, 0.f, -127.f, 127.f, qb)) return true;
  *offset = lo;
  const c10::Half guess((hi - lo) / 15.f);
  for (int step : {0, -1, 1, -2, 2}) {
    c10::Half h;
    h.x = static_cast<uint16_t>(guess.x + step);
    *scale = static_cast<float>(h);
    if (std::isfinite(*scale) && *scale >= 0.f && fits(blk, *scale, lo, 0.f, 15.f, qb)) return true;
  }
  return false;
}

// (q, scales, offsets) of w [N, K] fp32 when every block of 32 is exactly a Q8_0 or Q4_1 block (how such a
// file dequantizes); else nothing, as soon as one block is not.
std::optional<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>> q8_quantize_exact(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be [N, K] fp32");
  const int64_t N = w.size(0), K = w.size(1);
  if (K % kBlock != 0 || N == 0) return std::nullopt;
  auto q = torch::empty({N, K}, w.options().dtype(at::kChar));
  auto scales = torch::empty({N, K / kBlock}, w.options());
  auto offsets = torch::empty({N, K / kBlock}, w.options());
  const float* wp = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  float* op = offsets.data_ptr<float>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, N * (K / kBlock), 256, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi && exact.load(std::memory_order_relaxed); ++b)
      if (!quantize_block(wp + b * kBlock, sp + b, op + b, qp + b * kBlock)) exact.store(false);
  });
  if (!exact.load()) return std::nullopt;
  return std::make_tuple(q, scales, offsets);
}

}  // namespace

void register_linear(pybind11::module& m) {
  m.def("q8_linear", &q8_linear, "x @ an int8-block weight^T, fp32 (CPU)");
  m.def("q8_quantize_exact", &q8_quantize_exact, "w as int8 blocks where that is exact, else None (CPU)");
}
