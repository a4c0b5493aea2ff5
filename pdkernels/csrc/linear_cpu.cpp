// Linear layers on weights stored as int8 blocks (pdkernels/cpu.py, Q8Weight): per 32 weights of a row an
// fp32 scale and offset, w = q * scale + offset, which holds GGUF's Q8_0 (offset 0, q in [-127, 127]) and
// Q4_1 (offset its min, q in [0, 15]) exactly. A weight is stored so only where that is exact
// (q8_quantize_exact), i.e. where the model's fp32 weights were dequantized from such a file: y is then the
// fp32 product up to the summation order, while a decode step streams 1.25 bytes a weight instead of 4.
// Built with AVX2 + FMA only (the module has no q8_linear elsewhere, and such weights stay fp32).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <unistd.h>

namespace {

constexpr int64_t kBlock = 32;  // Q8_0's block: one scale per 32 weights of a row
constexpr int64_t kPanel = 8;   // output columns a panel: q [N / 8, K, 8], scales and offsets [N / 8, K / 32, 8]

// One weight: q * scale + offset rounded once (q * scale is exact: q has at most 8 bits, the scale an fp16's
// 11), the value a Q8_0 or Q4_1 file dequantizes to.
inline float weight(int8_t q, float scale, float offset) { return std::fmaf(static_cast<float>(q), scale, offset); }

#if defined(__AVX2__) && defined(__FMA__)
// y[m, :cols] for MR rows of x against one panel: at each k, the panel's 8 weights converted once (q
// sign-extended, q * scale + offset rounded once as weight()) and multiplied by each row's x[m, k]
// broadcast, the 8 columns' sums in the lanes of one register per row (no horizontal sums), U sets of
// them over alternating k so that at least 4 chains of FMAs are in flight. The panel layout makes a
// panel's K x 8 bytes one sequential stream. (Rows of w in turn, as before, had to reduce every row's
// sums across lanes and converted each block once per 4 rows of x; at 20 rows MKL's fp32 GEMM beat it.)
// A row's sums depend on U (its chains over alternating k), which MR sets; MR <= 3 all take U = 4, the order
// of a pass of one row (what rows_alone keeps).
template <int MR, int U = (MR <= 3 ? 4 : MR <= 6 ? 2 : 1)>
inline void panel_rows(const float* x, int64_t ldx, const int8_t* q, const float* s, const float* o, float* y,
                       int64_t ldy, int64_t K, int64_t cols, int64_t ahead) {
  __m256 acc[U][MR];  // every index a constant once unrolled, so that the sums stay in registers
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) acc[u][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m256 scale = _mm256_loadu_ps(s + b * kPanel), offset = _mm256_loadu_ps(o + b * kPanel);
    const int8_t* qb = q + b * kBlock * kPanel;
    const float* xb = x + b * kBlock;
    if (ahead != 0)  // one panel after another is sequential, but 2 x 32 rows of 8 bytes a block kept it waiting
      for (int64_t line = 0; line < kBlock * kPanel; line += 64) __builtin_prefetch(qb + ahead + line);
    for (int64_t j = 0; j < kBlock; j += U) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + (j + u) * kPanel));
        const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale, offset);
#pragma GCC unroll 12
        for (int m = 0; m < MR; ++m)
          acc[u][m] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + m * ldx + j + u), w, acc[u][m]);
      }
    }
  }
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    __m256 t = acc[0][m];
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, acc[u][m]);
    if (cols == kPanel) {
      _mm256_storeu_ps(y + m * ldy, t);
    } else {  // the last panel of an N that is not a multiple of 8
      float lanes[kPanel];
      _mm256_storeu_ps(lanes, t);
      std::copy_n(lanes, cols, y + m * ldy);
    }
  }
}

constexpr int kRowsMax = 12;  // rows of x a pass over a panel: 12 sums + scale, offset, w and x = 16 registers
constexpr int kRowsAlone = 3;  // rows_alone: up to 3 rows a pass, each summed as a pass of one row (U = 4)

// panel_rows for `rows` (1..MR) rows of x
template <int MR>
inline void panel_pass(int64_t rows, const float* x, int64_t ldx, const int8_t* q, const float* s, const float* o,
                       float* y, int64_t ldy, int64_t K, int64_t cols, int64_t ahead) {
  if (rows == MR)
    panel_rows<MR>(x, ldx, q, s, o, y, ldy, K, cols, ahead);
  else if constexpr (MR > 1)
    panel_pass<MR - 1>(rows, x, ldx, q, s, o, y, ldy, K, cols, ahead);
}

// x [M, K] fp32 (rows contiguous) @ w^T -> [M, N], w as panels (q8_quantize_exact); threads over panels,
// each panel read once per pass of up to 12 rows of x (M split into near-equal passes: 16 as 8 + 8). With
// rows_alone, passes of up to 3 rows whose sums each take the order of a call with that row alone, whatever
// M (pdkernels.invariant): every weight converted once a pass, the panel read from L1 after the first.
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                        const torch::Tensor& offsets, int64_t N, bool rows_alone) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [M, K] fp32 rows");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(2) == kPanel,
              "q must be [N / 8, K, 8] int8 panels");
  const int64_t M = x.size(0), K = x.size(1), panels = q.size(0);
  TORCH_CHECK(q.size(1) == K && K % kBlock == 0, "q must have K = x's columns, a multiple of 32");
  TORCH_CHECK(N > 0 && (N + kPanel - 1) / kPanel == panels, "N must be the weight's rows, 8 to a panel");
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == panels * K / kBlock * kPanel,
                "scales and offsets must be [N / 8, K / 32, 8] fp32");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t rows_max = rows_alone ? kRowsAlone : kRowsMax;
  const int64_t ldx = x.stride(0), nb = K / kBlock, passes = (M + rows_max - 1) / rows_max;
  at::parallel_for(0, panels, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      for (int64_t i = 0, m = 0; i < passes; ++i) {
        const int64_t rows = M / passes + (i < M % passes ? 1 : 0);
        const int64_t ahead = i == 0 && p + 2 < hi ? 2 * K * kPanel : 0;  // the panel after next, on the first pass
        const float* xr = xp + m * ldx;
        const int8_t* qr = qp + p * K * kPanel;
        const float *sr = sp + p * nb * kPanel, *orr = op + p * nb * kPanel;
        if (rows_alone)
          panel_pass<kRowsAlone>(rows, xr, ldx, qr, sr, orr, yp + m * N + p * kPanel, N, K, cols, ahead);
        else
          panel_pass<kRowsMax>(rows, xr, ldx, qr, sr, orr, yp + m * N + p * kPanel, N, K, cols, ahead);
        m += rows;
      }
    }
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

// (q, scales, offsets) of w [N, K] fp32 as panels of 8 rows (q [N / 8, K, 8], scales and offsets [N / 8, K /
// 32, 8]; a last panel's missing rows zero) when every block of 32 of a row is exactly a Q8_0 or Q4_1 block
// (how such a file dequantizes); else nothing, as soon as one block is not.
std::optional<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>> q8_quantize_exact(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be [N, K] fp32");
  const int64_t N = w.size(0), K = w.size(1), nb = K / kBlock, panels = (N + kPanel - 1) / kPanel;
  if (K % kBlock != 0 || N == 0) return std::nullopt;
  auto q = torch::zeros({panels, K, kPanel}, w.options().dtype(at::kChar));
  auto scales = torch::zeros({panels, nb, kPanel}, w.options());
  auto offsets = torch::zeros({panels, nb, kPanel}, w.options());
  const float* wp = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  float* op = offsets.data_ptr<float>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, N * nb, 256, [&](int64_t lo, int64_t hi) {
    int8_t qb[kBlock];
    for (int64_t i = lo; i < hi && exact.load(std::memory_order_relaxed); ++i) {
      const int64_t n = i / nb, b = i % nb, lane = n % kPanel, panel = n / kPanel;
      float scale, offset;
      if (!quantize_block(wp + i * kBlock, &scale, &offset, qb)) {
        exact.store(false);
        break;
      }
      sp[(panel * nb + b) * kPanel + lane] = scale;
      op[(panel * nb + b) * kPanel + lane] = offset;
      for (int64_t j = 0; j < kBlock; ++j) qp[(panel * K + b * kBlock + j) * kPanel + lane] = qb[j];
    }
  });
  if (!exact.load()) return std::nullopt;
  return std::make_tuple(q, scales, offsets);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 weights for decode-sized products on AVX-512 BF16 (vdpbf16ps: 16 lanes, each the sum of two bf16
// products into fp32). A weight [N, K] is stored once at load as panels of 32 output columns: for each pair
// of k, the panel's 32 columns' two weights side by side ([N / 32, K / 2, 32, 2]; a last panel's missing
// columns zero), so that one panel is one sequential stream of 128 bytes a pair of k and each 64 bytes is
// one vdpbf16ps operand. A row of x's pair (x[m, k], x[m, k + 1]) is broadcast to all lanes; each column's
// sum runs in one lane over k in order, the same whatever rows share the pass: a row's result does not
// depend on M (batch-invariant by construction).
constexpr int64_t kBfPanel = 32;  // output columns a panel: two zmm of fp32 sums a row
constexpr int kBfRowsMax = 12;    // rows a pass: 24 sums + 2 weights + 1 broadcast of the 32 zmm registers

torch::Tensor bf16_pack_panels(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be [N, K] bf16");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kBfPanel - 1) / kBfPanel;
  TORCH_CHECK(K % 2 == 0 && K > 0 && N > 0, "w must have an even number of columns (vdpbf16ps takes pairs)");
  auto padded = torch::zeros({panels * kBfPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // [P, 32, K / 2, 2] -> [P, K / 2, 32, 2]
  return padded.view({panels, kBfPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// y[m, cols] for MR rows of x against one panel (K / 2 pairs), rounded to bf16 once at the end; next, where
// given, the panel to fetch into cache as this one is read, two lines a pair of k: without it a pass of 12
// rows fetched a panel, then computed on it, the two never overlapping (experiments/bench/bench_bf16_linear.py).
template <int MR>
inline void bf16_panel_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y, int64_t ldy,
                            int64_t K, int64_t cols, const uint16_t* next) {
  __m512 lo[MR], hi[MR];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t* wk = w + k * kBfPanel;
    if (next != nullptr) {  // the next panel's same two lines, as this one's are used
      __builtin_prefetch(next + k * kBfPanel);
      __builtin_prefetch(next + k * kBfPanel + kBfPanel);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + kBfPanel);
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + k, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      lo[m] = _mm512_dpbf16_ps(lo[m], xb, w0);
      hi[m] = _mm512_dpbf16_ps(hi[m], xb, w1);
    }
  }
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(lo[m])),
                                            (__m256i)_mm512_cvtneps_pbh(hi[m]), 1);
    _mm512_mask_storeu_epi16(y + m * ldy, cols == kBfPanel ? ~__mmask32(0) : (__mmask32(1) << cols) - 1, both);
  }
}

template <int MR>
inline void bf16_panel_pass(int64_t rows, const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* y,
                            int64_t ldy, int64_t K, int64_t cols, const uint16_t* next) {
  if (rows == MR)
    bf16_panel_rows<MR>(x, ldx, w, y, ldy, K, cols, next);
  else if constexpr (MR > 1)
    bf16_panel_pass<MR - 1>(rows, x, ldx, w, y, ldy, K, cols, next);
}

// x [M, K] bf16 (rows contiguous) @ w^T -> [M, N] bf16, w as bf16_pack_panels stored it; threads over panels,
// each panel read once per pass of up to 12 rows of x (M split into near-equal passes: 20 as 10 + 10), the
// passes after the first from cache. Each row's sums are the same whatever M (see above).
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16 rows");
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                  panels.size(2) == kBfPanel && panels.size(3) == 2,
              "panels must be [N / 32, K / 2, 32, 2] bf16 (bf16_pack_panels)");
  const int64_t M = x.size(0), K = x.size(1), count = panels.size(0);
  TORCH_CHECK(panels.size(1) * 2 == K, "panels must have K = x's columns");
  TORCH_CHECK(N > 0 && (N + kBfPanel - 1) / kBfPanel == count, "N must be the weight's rows, 32 to a panel");
  TORCH_CHECK(x.stride(0) % 2 == 0, "x's rows must start at even columns (pairs of bf16)");
  RECORD_FUNCTION("pdk::bf16_linear", std::vector<c10::IValue>());  // called from Python and from C++ alike
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ldx = x.stride(0), passes = (M + kBfRowsMax - 1) / kBfRowsMax, stride = K * kBfPanel;
  at::parallel_for(0, count, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t cols = std::min(kBfPanel, N - p * kBfPanel);
      const uint16_t* w = wp + p * stride;
      for (int64_t i = 0, m = 0; i < passes; ++i) {
        const int64_t rows = M / passes + (i < M % passes ? 1 : 0);
        const uint16_t* next = i == 0 && p + 1 < hi ? w + stride : nullptr;  // prefetched as this one is read
        bf16_panel_pass<kBfRowsMax>(rows, xp + m * ldx, ldx, w, yp + m * N + p * kBfPanel, N, K, cols, next);
        m += rows;
      }
    }
  });
  return y;
}
#endif

// Bytes of a core's own L2 (0 where the system does not say).
int64_t l2_bytes() {
  static const int64_t bytes = std::max<long>(0, sysconf(_SC_LEVEL2_CACHE_SIZE));
  return bytes;
}

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, c10::IValue(), c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()),
                                 c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

torch::Tensor packed_linear(const torch::Tensor& x_in, const torch::Tensor& w);

#if defined(__AVX2__) && defined(__FMA__)
// What pdkernels.cpu.linear does with a Q8Weight (w its fp32 weight, q, scales and offsets its int8 copy): up to
// max_rows rows of x the int8 copy, more rows the fp32 weight's GEMM (torch.mm), so the C++ step takes the
// Python layers' bits.
torch::Tensor q8_weight_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& q,
                               const torch::Tensor& scales, const torch::Tensor& offsets, int64_t max_rows) {
  if (x.size(0) > max_rows) return torch::mm(x, w.t());
  return q8_linear(x.stride(1) == 1 ? x : x.contiguous(), q, scales, offsets, w.size(0), false);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// What pdkernels.cpu.linear does with a PanelWeight (w in oneDNN's layout, panels its bf16_pack_panels copy):
// up to max_rows rows of x the panels, more rows oneDNN's GEMM, so the C++ step takes the Python layers' bits.
torch::Tensor bf16_weight_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& panels,
                                 int64_t max_rows) {
  if (x.size(0) > max_rows) return packed_linear(x, w);
  return bf16_linear(x.stride(1) == 1 && x.stride(0) % 2 == 0 ? x : x.contiguous(), panels, w.size(0));
}
#endif

// x [M, K] @ w^T for a weight pdkernels.cpu.pack stored in oneDNN's layout (torch.ops.mkldnn._linear_pointwise).
// On several threads, where the weight fits one core's L2 and every thread has at least kSplitRows rows, each
// thread multiplies its own block of rows on one thread (a nested oneDNN call runs single-threaded) instead of
// oneDNN dividing the product: oneDNN's own division of a narrow weight (SmolLM2's down projection, K 1,536,
// N 576) left it at one core's speed. A weight larger than L2 stays oneDNN's, whose division by columns keeps
// half of it in each core's L2.
torch::Tensor packed_linear(const torch::Tensor& x_in, const torch::Tensor& w) {
  constexpr int64_t kSplitRows = 128;
  const auto x = x_in.contiguous();
  const int64_t rows = x.size(0), threads = at::get_num_threads();
  const int64_t weight_bytes = w.numel() * w.element_size();
  if (threads < 2 || at::in_parallel_region() || rows < threads * kSplitRows || weight_bytes > l2_bytes())
    return onednn_linear(x, w);
  const int64_t n = w.size(0), chunk = (rows + threads - 1) / threads;
  auto out = torch::empty({rows, n}, x.options());
  auto* dst = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = n * out.element_size();
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {  // bytes copied, not copy_: the caller's InferenceMode is its thread's
      const int64_t a = t * chunk, b = std::min(rows, a + chunk);
      if (a < b) std::memcpy(dst + a * row_bytes, onednn_linear(x.slice(0, a, b), w).data_ptr(), (b - a) * row_bytes);
    }
  });
  return out;
}

void register_linear(pybind11::module& m) {
  m.def("packed_linear", &packed_linear, "x @ w^T for a weight in oneDNN's layout, rows split over threads where "
        "that is faster (CPU)");
#if defined(__AVX2__) && defined(__FMA__)
  m.def("q8_linear", &q8_linear, "x @ an int8-block weight^T, fp32 (CPU, AVX2)", py::arg("x"), py::arg("q"),
        py::arg("scales"), py::arg("offsets"), py::arg("n"), py::arg("rows_alone") = false);
  m.def("q8_quantize_exact", &q8_quantize_exact, "w as int8-block panels where that is exact, else None (CPU)");
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  m.def("bf16_linear", &bf16_linear, "x @ a bf16 weight's panels^T, decode-sized x (CPU, AVX-512 BF16)",
        py::arg("x"), py::arg("panels"), py::arg("n"));
  m.def("bf16_pack_panels", &bf16_pack_panels, "a bf16 weight [N, K] as bf16_linear's panels (CPU)");
#endif
  (void)m;
}
