// Causal attention of a prompt's chunk in bf16 on AMX tiles (pdkernels/cpu.py builds this with the other
// files into one module): a flash-style pass per (kv head, block of query rows) whose two GEMMs are
// oneDNN's batch-reduce GEMM kernels through torch's cpublas::brgemm (AMX where the CPU has it), the online
// softmax in AVX-512 between them, each kv head's keys and values packed once for all the query heads of
// its group and all their blocks. It replaces torch's flash kernel on AMX CPUs only, where it is faster
// (docs/results/kernels.md, "Why each CPU path is picked").
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "simd_cpu.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)

namespace {

// 2^t for t <= 0 to about 4e-5 relative: 2^n (scalef) times a quartic in the fraction. P goes to bf16 (2^-8
// relative), so pdk::exp_nonpositive16's precision buys nothing here, and its degree-6 polynomial and
// integer exponent cost a good part of the layer. The caller folds log2(e) into the scores' scale.
inline __m512 exp2_for_bf16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(9.6181291076e-3f);  // 2^f, degree 4 (Taylor in f ln 2): 4e-5 at |f| = 0.5
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

constexpr float kLog2e = 1.44269504088896341f;
constexpr int64_t kQ = 64;   // query rows a block
constexpr int64_t kKV = 256;  // keys a block (64, 128 and 512 measured: 256 the fastest)

// K [L, D] bf16 -> for each block of kKV keys, K^T in VNNI layout: [D / 2][kKV][2] (the pair of dims of
// one key side by side), the B operand of S = Q K^T; keys past L are zeros.
void pack_keys(const c10::BFloat16* k, int64_t len, int64_t dim, c10::BFloat16* out) {
  const int64_t blocks = (len + kKV - 1) / kKV;
  const auto* src = reinterpret_cast<const uint32_t*>(k);  // a key's dims in pairs
  auto* dst = reinterpret_cast<uint32_t*>(out);
  const int64_t pairs = dim / 2;
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t* block = dst + b * pairs * kKV;
    for (int64_t j = 0; j < kKV; ++j) {
      const int64_t key = b * kKV + j;
      for (int64_t p = 0; p < pairs; ++p) block[p * kKV + j] = key < len ? src[key * pairs + p] : 0u;
    }
  }
}

// V [L, D] bf16 -> per block of kKV keys, VNNI layout [kKV / 2][D][2] (two keys' values side by side), the
// B operand of O += P V; keys past L are zeros. Each pair of keys' rows interleaved 16 dims at a time.
void pack_values(const c10::BFloat16* v, int64_t len, int64_t dim, c10::BFloat16* out) {
  const int64_t pairs = (len + kKV - 1) / kKV * kKV / 2;
  const auto* src = reinterpret_cast<const uint16_t*>(v);
  auto* dst = reinterpret_cast<uint32_t*>(out);  // [pairs][dim] of (even key, odd key)
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t even = 2 * p, odd = 2 * p + 1;
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512i lo = even < len ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                          reinterpret_cast<const __m256i*>(src + even * dim + d)))
                                    : _mm512_setzero_si512();
      const __m512i hi = odd < len ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(src + odd * dim + d)))
                                   : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + p * dim + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

}  // namespace

// q [n, Hq, D] bf16 (a contiguous last dim, any other strides): the last n positions of a sequence; k, v
// [Hkv, L, D] bf16 contiguous, its L >= n keys. Query i (position L - n + i) attends keys 0..L - n + i.
// Returns [n, Hq, D] bf16: extend_attention_ref's causal attention.
torch::Tensor causal_attention_amx(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "q: [n, Hq, D] bf16");
  TORCH_CHECK(k.dim() == 3 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
                  k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "k, v: [Hkv, L, D] bf16 contiguous");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(0), len = k.size(1);
  TORCH_CHECK(k.size(2) == dim && dim % 32 == 0 && heads % kv_heads == 0 && len >= n, "q and k disagree");
  const int64_t group = heads / kv_heads, blocks = (len + kKV - 1) / kKV, offset = len - n;
  auto out = torch::empty({n, heads, dim}, q.options());
  // every kv head's keys and values packed once
  auto packed_k = torch::empty({kv_heads, blocks * kKV * dim}, k.options());
  auto packed_v = torch::empty({kv_heads, blocks * kKV * dim}, k.options());
  const auto* kp = k.data_ptr<c10::BFloat16>();
  const auto* vp = v.data_ptr<c10::BFloat16>();
  at::parallel_for(0, kv_heads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t h = lo; h < hi; ++h) {
      pack_keys(kp + h * len * dim, len, dim, packed_k.data_ptr<c10::BFloat16>() + h * blocks * kKV * dim);
      pack_values(vp + h * len * dim, len, dim, packed_v.data_ptr<c10::BFloat16>() + h * blocks * kKV * dim);
    }
  });
  const auto* qp = q.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t q_blocks = (n + kQ - 1) / kQ, ld_q = q.stride(0);
  const float fscale = static_cast<float>(scale);
  // work items: (query head, block of query rows), the last (longest) and first blocks in turn, so that
  // each thread's contiguous range holds as much work as another's
  at::parallel_for(0, heads * q_blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> s(kQ * kKV), o(kQ * dim), m(kQ), l(kQ), tmp(kQ * dim);
    std::vector<c10::BFloat16> p(kQ * kKV);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t head = item % heads, turn = item / heads;  // blocks long and short in turn: even halves
      const int64_t qb = turn % 2 == 0 ? q_blocks - 1 - turn / 2 : turn / 2;
      const int64_t r0 = qb * kQ, rows = std::min(kQ, n - r0), h = head / group;
      const c10::BFloat16* a = qp + r0 * ld_q + head * dim;
      const c10::BFloat16* kh = packed_k.data_ptr<c10::BFloat16>() + h * blocks * kKV * dim;
      const c10::BFloat16* vh = packed_v.data_ptr<c10::BFloat16>() + h * blocks * kKV * dim;
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      std::fill(o.begin(), o.end(), 0.0f);
      const int64_t last_key = offset + r0 + rows - 1;  // the block's last row sees keys up to here
      const int64_t kv_blocks = last_key / kKV + 1;
      for (int64_t kb = 0; kb < kv_blocks; ++kb) {
        at::native::cpublas::brgemm(rows, kKV, dim, ld_q, kKV, kKV, false, a, kh + kb * kKV * dim, s.data());
        const bool masked = (kb + 1) * kKV - 1 > offset + r0;  // some key of the block is past some row
        for (int64_t r = 0; r < rows; ++r) {
          float* row = s.data() + r * kKV;
          const int64_t keep = masked ? std::clamp<int64_t>(offset + r0 + r - kb * kKV + 1, 0, kKV) : kKV;
          const float inf = std::numeric_limits<float>::infinity();
          const int64_t full = keep / 16 * 16, seen = (keep + 15) / 16 * 16;  // whole groups; any lane seen
          const __mmask16 tail = static_cast<__mmask16>((1u << (keep - full)) - 1);  // the last group's lanes
          __m512 vmax = _mm512_set1_ps(-inf);
          for (int64_t j = 0; j < full; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + j));
          if (full < seen) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_loadu_ps(row + full));
          const float new_max = std::max(m[r], _mm512_reduce_max_ps(vmax) * fscale);
          if (new_max == -inf) {  // no key seen yet (not reached: key 0 is in every row's first block)
            std::memset(p.data() + r * kKV, 0, kKV * sizeof(c10::BFloat16));
            continue;
          }
          const float alpha = new_max == m[r] ? 1.0f : pdk::exp_nonpositive(m[r] - new_max);  // exp(-inf) ~ 1.6e-38: l, o are 0
          // exp(score x scale - max) = 2^(score x scale log2 e - max log2 e); P in bf16, l summed in fp32
          const __m512 top = _mm512_set1_ps(new_max * kLog2e), vscale = _mm512_set1_ps(fscale * kLog2e);
          c10::BFloat16* prow = p.data() + r * kKV;
          __m512 sum = _mm512_setzero_ps();
          for (int64_t j = 0; j < full; j += 16) {
            const __m512 e = exp2_for_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), vscale, top));
            sum = _mm512_add_ps(sum, e);
            pdk::store_bf16_16(prow + j, e);
          }
          if (full < seen) {  // 0 for the keys this row does not see
            const __m512 e = _mm512_maskz_mov_ps(tail, exp2_for_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(row + full), vscale, top)));
            sum = _mm512_add_ps(sum, e);
            pdk::store_bf16_16(prow + full, e);
          }
          if (seen < kKV) std::memset(prow + seen, 0, (kKV - seen) * sizeof(c10::BFloat16));
          l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
          m[r] = new_max;
          if (alpha == 1.0f) continue;  // the running max held: o as it is
          const __m512 va = _mm512_set1_ps(alpha);
          for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(o.data() + r * dim + d, _mm512_mul_ps(_mm512_loadu_ps(o.data() + r * dim + d), va));
        }
        at::native::cpublas::brgemm(rows, dim, kKV, kKV, dim, dim, true, p.data(), vh + kb * kKV * dim, o.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
        c10::BFloat16* dst = op + (r0 + r) * heads * dim + head * dim;
        for (int64_t d = 0; d < dim; d += 16)
          pdk::store_bf16_16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o.data() + r * dim + d), inv));
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}

torch::Tensor gather_kv(torch::Tensor cache, torch::Tensor pages, int64_t seq_len);  // paged_cpu.cpp

// q [T, Hq, D] bf16 (a contiguous last dim): a step's prompt tokens, request b's rows qo_indptr[b]..[b + 1];
// cache [pages, 2, Hkv, P, D] bf16; the page tables int32. Each request's causal attention over its pages
// (its K and V gathered, then causal_attention_amx); one request over every row is the output as it is,
// else each request's rows in a zeroed [T, Hq, D]. pdkernels.extend_attention_cpu's path in bf16 on AMX,
// and the C++ layers' (layers_cpu.cpp).
torch::Tensor extend_attention_amx(torch::Tensor q, torch::Tensor cache, torch::Tensor qo_indptr,
                                   torch::Tensor kv_indptr, torch::Tensor kv_indices,
                                   torch::Tensor kv_last_page_len, double scale) {
  for (const auto& t : {qo_indptr, kv_indptr, kv_indices, kv_last_page_len})
    TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), "page table: int32, contiguous");
  TORCH_CHECK(cache.dim() == 5 && qo_indptr.size(0) == kv_indptr.size(0), "cache: 5-D HND; one indptr a request");
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  const int64_t batch = qo_indptr.size(0) - 1, page_size = cache.size(3), tokens = q.size(0);
  std::vector<std::tuple<int64_t, int64_t, torch::Tensor>> parts;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pages = indptr[b + 1] - indptr[b];
    const int64_t seq_len = pages ? (pages - 1) * page_size + last[b] : 0;
    if (qo[b + 1] == qo[b] || seq_len == 0) continue;
    auto kv = pdk::recorded("pdk::gather_kv", [&] {
      return gather_kv(cache, kv_indices.slice(0, indptr[b], indptr[b + 1]), seq_len);
    });
    parts.emplace_back(qo[b], qo[b + 1], pdk::recorded("pdk::causal_attention_amx", [&] {
                         return causal_attention_amx(q.slice(0, qo[b], qo[b + 1]), kv[0], kv[1], scale);
                       }));
  }
  if (parts.size() == 1 && std::get<0>(parts[0]) == 0 && std::get<1>(parts[0]) == tokens)
    return std::get<2>(parts[0]);
  auto out = torch::zeros_like(q);
  for (const auto& [lo, hi, part] : parts) out.slice(0, lo, hi).copy_(part);
  return out;
}

void register_attention_amx(pybind11::module& m) {
  if (!at::native::cpublas::could_pack(at::kBFloat16)) return;  // no AMX: not offered (torch's flash serves)
  m.def("causal_attention_amx", &causal_attention_amx,
        "causal attention of a prompt's chunk, bf16, on oneDNN's brgemm (AMX) with an AVX-512 softmax (CPU)");
  m.def("extend_attention_amx", &extend_attention_amx, "each request's causal_attention_amx over its pages (CPU)");
}

#else

void register_attention_amx(pybind11::module&) {}  // built without AVX-512 BF16: torch's flash kernel serves

#endif
