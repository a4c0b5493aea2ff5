// A dense Llama-family model's step through all its layers in one call (pdkernels/cpu.py builds this with the
// other files into one module): decode steps, and on AMX CPUs steps with prompt tokens too. The same kernels
// in the same order as engine.model.Model.forward on the CPU (oneDNN's GEMMs on prepacked bf16 weights,
// this extension's rope, KV append, attention, residual add + RMSNorm and SwiGLU), so the same bits,
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

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& w);  // linear_cpu.cpp

using pdk::recorded;

namespace {

// Per layer: the packed qkv, o, gate_up and down weights and the two norms' weights; head counts and sizes.
class DenseDecoder {
 public:
  DenseDecoder(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> norms, torch::Tensor final_norm,
               int64_t q_heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : weights_(std::move(weights)),
        norms_(std::move(norms)),
        final_norm_(final_norm),
        q_heads_(q_heads),
        kv_heads_(kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale) {
    TORCH_CHECK(weights_.size() % 4 == 0 && norms_.size() == weights_.size() / 2, "4 weights, 2 norms a layer");
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
    TORCH_CHECK(!qo_indptr || extends(), "qo_indptr: steps with prompt tokens need AMX here");
    const int64_t layers = static_cast<int64_t>(weights_.size() / 4), tokens = x.size(0);
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == layers, "kv_cache: [layers, pages, 2, Hkv, P, D]");
    const int64_t qk = q_heads_ + kv_heads_;
    for (int64_t i = 0; i < layers; ++i) {
      const torch::Tensor* w = &weights_[4 * i];
      const auto cache = kv_cache.select(0, i);
      auto qkv = packed_linear(h, w[0]).view({tokens, -1, head_dim_});
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
      auto attn = packed_linear(o.reshape({tokens, -1}), w[1]);
      if (counter) (*counter)[0][i] += 1;
      h = recorded("pdk::add_rms_norm", [&] { return add_rms_norm(x, attn, norms_[2 * i + 1], eps_); });
      auto act = recorded("pdk::silu_mul", [&] { return silu_mul(packed_linear(h, w[2])); });
      auto mlp = packed_linear(act, w[3]);
      const auto& next = i + 1 == layers ? final_norm_ : norms_[2 * (i + 1)];
      h = recorded("pdk::add_rms_norm", [&] { return add_rms_norm(x, mlp, next, eps_); });
    }
    return h;
  }

 private:
  std::vector<torch::Tensor> weights_, norms_;
  torch::Tensor final_norm_;
  int64_t q_heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace

void register_layers(pybind11::module& m) {
  pybind11::class_<DenseDecoder>(m, "DenseDecoder")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, torch::Tensor, int64_t, int64_t,
                          int64_t, double, double>())
      .def_static("extends", &DenseDecoder::extends, "whether run takes steps with prompt tokens (AMX)")
      .def("run", &DenseDecoder::run, "a step through every layer (CPU)",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
