// A dense Llama-family model's step through all its layers in one call (pdkernels/cpu.py builds this with the
// other files into one module): decode steps, and on AMX CPUs steps with prompt tokens too. The same kernels
// in the same order as engine.model.Model.forward on the CPU (oneDNN's GEMMs on prepacked bf16 weights, or
// on AVX2 the int8-block kernel on fp32 weights that are exactly such blocks; this extension's rope, KV
// append, attention, residual add + RMSNorm and SwiGLU), so the same bits,
// without the Python between them: about 40 Python-level calls a layer, whose overhead is a large share
// of a small model's decode step.
#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "simd_cpu.h"

// paged_cpu.cpp, decode_cpu.cpp
void kv_append(torch::Tensor k, torch::Tensor v, torch::Tensor batch_indices, torch::Tensor positions,
               torch::Tensor cache, torch::Tensor kv_indices, torch::Tensor kv_indptr);
torch::Tensor add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
                           double eps);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
// attention_amx.cpp
torch::Tensor extend_attention_amx(torch::Tensor q, torch::Tensor cache, torch::Tensor qo_indptr,
                                   torch::Tensor kv_indptr, torch::Tensor kv_indices,
                                   torch::Tensor kv_last_page_len, double scale);
#endif
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor kv_indptr,
                               torch::Tensor kv_indices, torch::Tensor kv_last_page_len, double scale);

// linear_cpu.cpp
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& w);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
torch::Tensor bf16_weight_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& panels,
                                 int64_t max_rows);
#endif
#if defined(__AVX2__) && defined(__FMA__)
torch::Tensor q8_weight_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& q,
                               const torch::Tensor& scales, const torch::Tensor& offsets, int64_t max_rows);
#endif

using pdk::recorded;

namespace {

// Per layer: the qkv, o, gate_up and down weights (oneDNN-packed bf16, with panels holding each one's
// bf16_pack_panels copy or none; or fp32 with q8 holding each one's int8 copy: q, scales, offsets), with
// max_rows the most rows either copy takes (pdkernels.cpu.PANEL_MAX_M, Q8_MAX_M), and the two norms'
// weights; head counts and sizes.
class DenseDecoder {
 public:
  DenseDecoder(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> q8, std::vector<torch::Tensor> panels,
               int64_t max_rows, std::vector<torch::Tensor> norms, torch::Tensor final_norm, int64_t q_heads,
               int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : weights_(std::move(weights)),
        q8_(std::move(q8)),
        panels_(std::move(panels)),
        max_rows_(max_rows),
        norms_(std::move(norms)),
        final_norm_(final_norm),
        q_heads_(q_heads),
        kv_heads_(kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale) {
    TORCH_CHECK(weights_.size() % 4 == 0 && norms_.size() == weights_.size() / 2, "4 weights, 2 norms a layer");
    TORCH_CHECK(q8_.empty() || q8_.size() == 3 * weights_.size(), "q8: none, or q, scales, offsets a weight");
    TORCH_CHECK(panels_.empty() || (q8_.empty() && panels_.size() == weights_.size()), "panels: none, or one a weight");
#if !(defined(__AVX2__) && defined(__FMA__))
    TORCH_CHECK(q8_.empty(), "int8-block weights need AVX2 + FMA");
#endif
#if !(defined(__AVX512F__) && defined(__AVX512BF16__))
    TORCH_CHECK(panels_.empty(), "bf16 panels need AVX-512 BF16");
#endif
  }

  // Whether run can take steps with prompt tokens: their causal attention on AMX (attention_amx.cpp)
  static bool extends() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return at::native::cpublas::could_pack(at::kBFloat16);
#else
    return false;
#endif
  }

  // x [T, H] the residual stream (updated in place), h its first layer's normed input; cos, sin [T, D / 2];
  // the page tables int32; kv_cache [layers, pages, 2, Hkv, P, D]; counter [2, layers] int32 or none (a
  // layer's count bumped after its output projection); qo_indptr [B + 1] int32 for a step with prompt
  // tokens (extends()), none for one token a sequence (decode). Returns the final norm's output [T, H].
  torch::Tensor run(torch::Tensor x, torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor batch_indices, torch::Tensor positions, torch::Tensor kv_indices,
                    torch::Tensor kv_indptr, torch::Tensor kv_last_page_len, torch::Tensor kv_cache,
                    std::optional<torch::Tensor> counter, std::optional<torch::Tensor> qo_indptr) const {
    TORCH_CHECK(!qo_indptr || (extends() && q8_.empty()), "qo_indptr: steps with prompt tokens need AMX and bf16");
    const int64_t layers = static_cast<int64_t>(weights_.size() / 4), tokens = x.size(0);
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == layers, "kv_cache: [layers, pages, 2, Hkv, P, D]");
    const int64_t qk = q_heads_ + kv_heads_;
    for (int64_t i = 0; i < layers; ++i) {
      const auto cache = kv_cache.select(0, i);
      auto qkv = linear(h, 4 * i).view({tokens, -1, head_dim_});
      auto rotated = recorded("pdk::rope", [&] { return rope(qkv.narrow(1, 0, qk), cos, sin); });
      auto k = rotated.narrow(1, q_heads_, kv_heads_), v = qkv.narrow(1, qk, kv_heads_);
      recorded("pdk::kv_append", [&] {
        kv_append(k, v, batch_indices, positions, cache, kv_indices, kv_indptr);
        return 0;
      });
      torch::Tensor o;
      if (qo_indptr) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        o = extend_attention_amx(rotated.narrow(1, 0, q_heads_), cache, *qo_indptr, kv_indptr, kv_indices,
                                 kv_last_page_len, scale_);
#endif
      } else {
        auto q = rotated.narrow(1, 0, q_heads_).to(at::kFloat).contiguous();
        o = recorded("pdk::decode_attention", [&] {
          return decode_attention(q, cache, kv_indptr, kv_indices, kv_last_page_len, scale_);
        });
        o = o.to(x.scalar_type());
      }
      auto attn = linear(o.reshape({tokens, -1}), 4 * i + 1);
      if (counter) (*counter)[0][i] += 1;
      h = recorded("pdk::add_rms_norm", [&] { return add_rms_norm(x, attn, norms_[2 * i + 1], eps_); });
      auto act = recorded("pdk::silu_mul", [&] { return silu_mul(linear(h, 4 * i + 2)); });
      auto mlp = linear(act, 4 * i + 3);
      const auto& next = i + 1 == layers ? final_norm_ : norms_[2 * (i + 1)];
      h = recorded("pdk::add_rms_norm", [&] { return add_rms_norm(x, mlp, next, eps_); });
    }
    return h;
  }

 private:
  // x @ weight i^T, as pdkernels.cpu.linear takes it (packed bf16, its panels or the int8 copy up to
  // max_rows_ rows)
  torch::Tensor linear(const torch::Tensor& x, size_t i) const {
#if defined(__AVX2__) && defined(__FMA__)
    if (!q8_.empty())
      return recorded("pdk::q8_linear", [&] {
        return q8_weight_linear(x, weights_[i], q8_[3 * i], q8_[3 * i + 1], q8_[3 * i + 2], max_rows_);
      });
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (!panels_.empty())  // recorded as pdk::bf16_linear where the panels serve
      return bf16_weight_linear(x, weights_[i], panels_[i], max_rows_);
#endif
    return packed_linear(x, weights_[i]);
  }

  std::vector<torch::Tensor> weights_, q8_, panels_;
  int64_t max_rows_;
  std::vector<torch::Tensor> norms_;
  torch::Tensor final_norm_;
  int64_t q_heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace

void register_layers(pybind11::module& m) {
  pybind11::class_<DenseDecoder>(m, "DenseDecoder")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          int64_t, std::vector<torch::Tensor>, torch::Tensor, int64_t, int64_t, int64_t, double,
                          double>())
      .def_static("extends", &DenseDecoder::extends, "whether run takes steps with prompt tokens (AMX)")
      .def("run", &DenseDecoder::run, "a step through every layer (CPU)",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
