// The routed experts of a LatentMoE layer on the CPU for a serving step: the operator k3_cpu::moe_experts.
// k3.model.moe's dispatch (sort the assignments by expert, one matmul chain per active expert from Python,
// weight and scatter back) is the reference; at decoding sizes (a few tokens, two of sixteen experts each) its
// ~20 ATen calls per layer cost more than the matmuls. Here: a counting sort of the assignments, each active
// expert's rows gathered and sent through gate/up, the activation and down as three BLAS calls (experts in
// parallel), and each token's weighted sum taken in ascending expert order, as the reference's index_add.
//
// z (T, L); experts, weights (T, K) (expert ids int64, weights in z's dtype); w1[e], w3[e] (I, L)
// and w2[e] (L, I) contiguous, expert e's gate, up and down projections. Returns u (T, L). float32, float64, or
// bfloat16 (matmuls through ATen's, the activation in fp32, each token's sum in fp32, rounded once).

#include <torch/library.h>

#include <string>
#include <vector>

#include "moe_dispatch.h"

namespace {

using k3_moe::matmul_bt;

template <typename T>
void experts(const at::Tensor& z, const at::Tensor& experts_tk, const at::Tensor& weights_tk,
             const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& w3, const std::vector<at::Tensor>& w2,
             bool situ, double beta1, double beta2, at::Tensor& out) {
  const int64_t T_ = z.size(0), L = z.size(1), K = experts_tk.size(1), E = static_cast<int64_t>(w1.size());
  const int64_t I = w1[0].size(0), A = T_ * K;
  const T* zp = z.data_ptr<T>();
  const k3_moe::Sorted s = k3_moe::sort_by_expert(experts_tk.data_ptr<int64_t>(), A, E);
  const auto& start = s.start;
  // gate and up of every assignment, in sorted order: (A, I) each
  auto gate = at::empty({A, I}, z.options()), up = at::empty({A, I}, z.options());
  T* gp = gate.data_ptr<T>();
  T* upp = up.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(s.active.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> zb;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = s.active[i], n = start[e + 1] - start[e];
      zb.resize(n * L);
      for (int64_t r = 0; r < n; ++r) std::copy_n(zp + (s.order[start[e] + r] / K) * L, L, zb.data() + r * L);
      matmul_bt<T>(n, I, L, zb.data(), w1[e].data_ptr<T>(), gp + start[e] * I);
      matmul_bt<T>(n, I, L, zb.data(), w3[e].data_ptr<T>(), upp + start[e] * I);
    }
  });
  const at::Tensor act = k3_moe::activation(gate, up, situ, beta1, beta2);
  const T* ap = act.data_ptr<T>();
  std::vector<T> h(A * L);  // every assignment's expert output, in sorted order
  at::parallel_for(0, static_cast<int64_t>(s.active.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = s.active[i], n = start[e + 1] - start[e];
      matmul_bt<T>(n, L, I, ap + start[e] * I, w2[e].data_ptr<T>(), h.data() + start[e] * L);
    }
  });
  k3_moe::combine<T>(s, h.data(), weights_tk.data_ptr<T>(), T_, K, L, out.data_ptr<T>());
}

at::Tensor moe_experts(const at::Tensor& z_in, const at::Tensor& experts_in, const at::Tensor& weights_in,
                       at::TensorList w1, at::TensorList w3, at::TensorList w2, std::string act, double beta1,
                       double beta2) {
  // any strides (a compiled graph hands over top-k's slices as they are): contiguous copies where needed
  const at::Tensor z = z_in.contiguous(), experts_tk = experts_in.contiguous(), weights_tk = weights_in.contiguous();
  const int64_t E = static_cast<int64_t>(w1.size());
  TORCH_CHECK(E > 0 && static_cast<int64_t>(w3.size()) == E && static_cast<int64_t>(w2.size()) == E,
              "moe_experts: w1, w3, w2 must hold one weight per expert each");
  k3_moe::check_routing(z, experts_tk, weights_tk, E, act, "moe_experts", /*bf16=*/true);
  const int64_t I = w1[0].size(0), L = z.size(1);
  const auto dt = z.scalar_type();
  std::vector<at::Tensor> a(w1.begin(), w1.end()), b(w3.begin(), w3.end()), c(w2.begin(), w2.end());
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(a[e].sizes() == at::IntArrayRef({I, L}) && b[e].sizes() == at::IntArrayRef({I, L}) &&
                    c[e].sizes() == at::IntArrayRef({L, I}) && a[e].is_contiguous() && b[e].is_contiguous() &&
                    c[e].is_contiguous() && a[e].scalar_type() == dt && b[e].scalar_type() == dt &&
                    c[e].scalar_type() == dt,
                "moe_experts: expert ", e, "'s weights must be contiguous (I, L), (I, L), (L, I) in z's dtype");
  auto out = at::empty_like(z);
  if (z.size(0) == 0) return out;
  if (dt == at::kFloat)
    experts<float>(z, experts_tk, weights_tk, a, b, c, act == "situ", beta1, beta2, out);
  else if (dt == at::kBFloat16)
    experts<at::BFloat16>(z, experts_tk, weights_tk, a, b, c, act == "situ", beta1, beta2, out);
  else
    experts<double>(z, experts_tk, weights_tk, a, b, c, act == "situ", beta1, beta2, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3_cpu, m) {
  m.def(
      "moe_experts(Tensor z, Tensor experts, Tensor weights, Tensor[] w1, Tensor[] w3, Tensor[] w2, str act, "
      "float beta1, float beta2) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3_cpu, CPU, m) { m.impl("moe_experts", &moe_experts); }
