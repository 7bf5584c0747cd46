// What the routed-expert kernels share (moe_experts_cpu.cpp: dense weights; moe_experts_mxfp4_cpu.cpp: MXFP4-packed
// ones): the counting sort of a step's assignments by expert, BLAS's matmul, the gated activation, and the
// weighted sum back per token in ascending expert order (as k3.model.moe.combine's index_add).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace k3_moe {

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

// The assignments (token t's k-th choice is assignment t·K + k) sorted by expert, stably (token order inside an
// expert, as argsort(stable)): expert e's assignments are order[start[e] .. start[e+1]), assignment a sits at
// sorted position slot[a], and active lists the experts with at least one.
struct Sorted {
  std::vector<int64_t> start, order, slot, active;
};

inline Sorted sort_by_expert(const int64_t* experts, int64_t A, int64_t E) {
  Sorted s{std::vector<int64_t>(E + 1, 0), std::vector<int64_t>(A), std::vector<int64_t>(A), {}};
  for (int64_t a = 0; a < A; ++a) ++s.start[experts[a] + 1];
  for (int64_t e = 0; e < E; ++e) s.start[e + 1] += s.start[e];
  std::vector<int64_t> next(s.start.begin(), s.start.end() - 1);
  for (int64_t a = 0; a < A; ++a) s.slot[a] = next[experts[a]]++, s.order[s.slot[a]] = a;
  for (int64_t e = 0; e < E; ++e)
    if (s.start[e + 1] > s.start[e]) s.active.push_back(e);
  return s;
}

// The routing's checks, in `op`'s name: z (T, L) float32 or float64, experts (T, K) int64 ids below E, weights
// (T, K) in z's dtype, act "situ" or "silu".
inline void check_routing(const at::Tensor& z, const at::Tensor& experts, const at::Tensor& weights, int64_t E,
                          const std::string& act, const char* op) {
  const auto dt = z.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, op, ": float32 or float64 inputs, got ", dt);
  TORCH_CHECK(z.dim() == 2, op, ": z must be a (T, L) tensor");
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == z.size(0) && experts.scalar_type() == at::kLong, op,
              ": experts must be an int64 (T, K) tensor");
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == dt, op,
              ": weights must be (T, K) in z's dtype");
  TORCH_CHECK(act == "situ" || act == "silu", op, ": act must be situ or silu, got ", act);
  const int64_t* ex = experts.data_ptr<int64_t>();
  for (int64_t i = 0; i < experts.numel(); ++i)
    TORCH_CHECK(ex[i] >= 0 && ex[i] < E, op, ": expert id ", ex[i], " is outside the ", E, " experts");
}

// act(gate, up) over every assignment at once with ATen's vectorised kernels, in situ.py's order of operations
// (libm's scalar tanh and exp cost more than the matmuls here).
inline at::Tensor activation(const at::Tensor& gate, const at::Tensor& up, bool situ, double beta1, double beta2) {
  if (!situ) return at::silu(gate).mul_(up);
  auto t1 = at::mul(gate, 1.0 / beta1).tanh_(), s = at::sigmoid(gate), t2 = at::mul(up, 1.0 / beta2).tanh_();
  return at::addcmul(at::zeros({}, gate.options()), t1, s, beta1 * beta2).mul_(t2);
}

// out (T, L): row t = Σ_k weights[t·K + k] · h[slot[t·K + k]], added in ascending sorted position (expert order).
template <typename T>
void combine(const Sorted& s, const T* h, const T* weights, int64_t T_, int64_t K, int64_t L, T* out) {
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> mine(K);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < K; ++k) mine[k] = {s.slot[t * K + k], t * K + k};
      std::sort(mine.begin(), mine.end());
      T* row = out + t * L;
      std::fill_n(row, L, T(0));
      for (const auto& [pos, a] : mine) {
        const T w = weights[a];
        const T* hr = h + pos * L;
        for (int64_t c = 0; c < L; ++c) row[c] += hr[c] * w;
      }
    }
  });
}

}  // namespace k3_moe
