// The routed experts of a LatentMoE layer on the CPU for a serving step: the operator k3_cpu::moe_experts.
// k3.model.moe's dispatch (sort the assignments by expert, one matmul chain per active expert from Python,
// weight and scatter back) is the reference; at decoding sizes (a few tokens, two of sixteen experts each) its
// ~20 ATen calls per layer cost more than the matmuls. Here: a counting sort of the assignments, each active
// expert's rows gathered and sent through gate/up, the activation and down as three BLAS calls (experts in
// parallel), and each token's weighted sum taken in ascending expert order, as the reference's index_add.
//
// z (T, L); experts, weights (T, K) (expert ids int64, weights in z's dtype); w1[e], w3[e] (I, L)
// and w2[e] (L, I) contiguous, expert e's gate, up and down projections. Returns u (T, L).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

extern "C" {  // Fortran BLAS (MKL in torch's x86 wheels), as chunk_kda_cpu.cpp
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

// Row-major C (m×n) = A (m×k) · Bᵀ with B stored n×k: the column-major Cᵀ = B Aᵀ.
template <typename T>
inline void matmul_bt(int64_t m, int64_t n, int64_t k, const T* A, const T* B, T* C) {
  const char ta = 'T', tb = 'N';
  const int im = static_cast<int>(n), in = static_cast<int>(m), ik = static_cast<int>(k);
  const T one = 1, zero = 0;
  if constexpr (std::is_same_v<T, float>)
    sgemm_(&ta, &tb, &im, &in, &ik, &one, B, &ik, A, &ik, &zero, C, &im);
  else
    dgemm_(&ta, &tb, &im, &in, &ik, &one, B, &ik, A, &ik, &zero, C, &im);
}

template <typename T>
void experts(const at::Tensor& z, const at::Tensor& experts_tk, const at::Tensor& weights_tk,
             const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& w3, const std::vector<at::Tensor>& w2,
             bool situ, double beta1, double beta2, at::Tensor& out) {
  const int64_t T_ = z.size(0), L = z.size(1), K = experts_tk.size(1), E = static_cast<int64_t>(w1.size());
  const int64_t I = w1[0].size(0), A = T_ * K;
  const int64_t* ex = experts_tk.data_ptr<int64_t>();
  const T* wt = weights_tk.data_ptr<T>();
  const T* zp = z.data_ptr<T>();
  // counting sort of the assignments by expert, stable (token order inside an expert, as argsort(stable))
  std::vector<int64_t> start(E + 1, 0), order(A), slot(A);
  for (int64_t a = 0; a < A; ++a) ++start[ex[a] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < A; ++a) slot[a] = next[ex[a]]++, order[slot[a]] = a;
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  // gate and up of every assignment, in sorted order: (A, I) each
  auto gate = at::empty({A, I}, z.options()), up = at::empty({A, I}, z.options());
  T* gp = gate.data_ptr<T>();
  T* upp = up.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> zb;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = active[i], n = start[e + 1] - start[e];
      zb.resize(n * L);
      for (int64_t r = 0; r < n; ++r) std::copy_n(zp + (order[start[e] + r] / K) * L, L, zb.data() + r * L);
      matmul_bt<T>(n, I, L, zb.data(), w1[e].data_ptr<T>(), gp + start[e] * I);
      matmul_bt<T>(n, I, L, zb.data(), w3[e].data_ptr<T>(), upp + start[e] * I);
    }
  });
  // the activation over all of them at once with ATen's vectorised kernels, in situ.py's order of operations
  // (libm's scalar tanh and exp cost more than the matmuls here)
  at::Tensor act;
  if (situ) {
    auto t1 = at::mul(gate, 1.0 / beta1).tanh_(), s = at::sigmoid(gate), t2 = at::mul(up, 1.0 / beta2).tanh_();
    act = at::addcmul(at::zeros({}, z.options()), t1, s, beta1 * beta2).mul_(t2);
  } else {
    act = at::silu(gate).mul_(up);
  }
  const T* ap = act.data_ptr<T>();
  std::vector<T> h(A * L);  // every assignment's expert output, in sorted order
  at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = active[i], n = start[e + 1] - start[e];
      matmul_bt<T>(n, L, I, ap + start[e] * I, w2[e].data_ptr<T>(), h.data() + start[e] * L);
    }
  });
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> mine(K);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < K; ++k) mine[k] = {slot[t * K + k], t * K + k};
      std::sort(mine.begin(), mine.end());  // ascending expert (sorted position), as the reference adds them
      T* row = op + t * L;
      std::fill_n(row, L, T(0));
      for (const auto& [pos, a] : mine) {
        const T w = wt[a];
        const T* hr = h.data() + pos * L;
        for (int64_t c = 0; c < L; ++c) row[c] += hr[c] * w;
      }
    }
  });
}

at::Tensor moe_experts(const at::Tensor& z_in, const at::Tensor& experts_in, const at::Tensor& weights_in,
                       at::TensorList w1, at::TensorList w3, at::TensorList w2, std::string act, double beta1,
                       double beta2) {
  // any strides (a compiled graph hands over top-k's slices as they are): contiguous copies where needed
  const at::Tensor z = z_in.contiguous(), experts_tk = experts_in.contiguous(), weights_tk = weights_in.contiguous();
  const auto dt = z.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "moe_experts: float32 or float64 inputs, got ", dt);
  TORCH_CHECK(z.dim() == 2, "moe_experts: z must be a (T, L) tensor");
  TORCH_CHECK(experts_tk.dim() == 2 && experts_tk.size(0) == z.size(0) && experts_tk.scalar_type() == at::kLong,
              "moe_experts: experts must be an int64 (T, K) tensor");
  TORCH_CHECK(weights_tk.sizes() == experts_tk.sizes() && weights_tk.scalar_type() == dt,
              "moe_experts: weights must be (T, K) in z's dtype");
  TORCH_CHECK(act == "situ" || act == "silu", "moe_experts: act must be situ or silu, got ", act);
  const int64_t E = static_cast<int64_t>(w1.size()), L = z.size(1);
  TORCH_CHECK(E > 0 && static_cast<int64_t>(w3.size()) == E && static_cast<int64_t>(w2.size()) == E,
              "moe_experts: w1, w3, w2 must hold one weight per expert each");
  const int64_t I = w1[0].size(0);
  std::vector<at::Tensor> a(w1.begin(), w1.end()), b(w3.begin(), w3.end()), c(w2.begin(), w2.end());
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(a[e].sizes() == at::IntArrayRef({I, L}) && b[e].sizes() == at::IntArrayRef({I, L}) &&
                    c[e].sizes() == at::IntArrayRef({L, I}) && a[e].is_contiguous() && b[e].is_contiguous() &&
                    c[e].is_contiguous() && a[e].scalar_type() == dt && b[e].scalar_type() == dt &&
                    c[e].scalar_type() == dt,
                "moe_experts: expert ", e, "'s weights must be contiguous (I, L), (I, L), (L, I) in z's dtype");
  const int64_t* ex = experts_tk.data_ptr<int64_t>();
  for (int64_t i = 0; i < experts_tk.numel(); ++i)
    TORCH_CHECK(ex[i] >= 0 && ex[i] < E, "moe_experts: expert id ", ex[i], " is outside the ", E, " experts");
  auto out = at::empty_like(z);
  if (z.size(0) == 0) return out;
  if (dt == at::kFloat)
    experts<float>(z, experts_tk, weights_tk, a, b, c, act == "situ", beta1, beta2, out);
  else
    experts<double>(z, experts_tk, weights_tk, a, b, c, act == "situ", beta1, beta2, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(k3_cpu, m) {
  m.def(
      "moe_experts(Tensor z, Tensor experts, Tensor weights, Tensor[] w1, Tensor[] w3, Tensor[] w2, str act, "
      "float beta1, float beta2) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3_cpu, CPU, m) { m.impl("moe_experts", &moe_experts); }
