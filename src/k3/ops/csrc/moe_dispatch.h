// What the routed-expert kernels share (moe_experts_cpu.cpp: dense weights; moe_experts_mxfp4_cpu.cpp: MXFP4-packed
// ones): the counting sort of a step's assignments by expert, BLAS's matmul, the gated activation, and the
// weighted sum back per token in ascending expert order (as k3.model.moe.combine's index_add).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "blas.h"

namespace k3_moe {

#if defined(__AVX512BF16__)
constexpr int64_t BF16_DIRECT_ROWS = 16;

// C (m×n) = A (m×k) · Bᵀ in bfloat16 for m ≤ BF16_DIRECT_ROWS with the CPU's bf16 dot-product instruction
// (vdpbf16ps: pairs of bf16 products summed into fp32 lanes): each weight row is read once and multiplied into
// every row of A. oneDNN's call costs ~50 µs at these sizes, more than the arithmetic.
inline void matmul_bt_bf16_rows(int64_t m, int64_t n, int64_t k, const at::BFloat16* A, const at::BFloat16* B,
                                at::BFloat16* C) {
  const int64_t k32 = k - k % 32;
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* b = B + j * k;
    __m512 acc[BF16_DIRECT_ROWS];
    for (int64_t r = 0; r < m; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k32; c += 32) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(b + c);
      for (int64_t r = 0; r < m; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(A + r * k + c), w);
    }
    for (int64_t r = 0; r < m; ++r) {
      float sum = _mm512_reduce_add_ps(acc[r]);
      for (int64_t c = k32; c < k; ++c) sum += static_cast<float>(A[r * k + c]) * static_cast<float>(b[c]);
      C[r * n + j] = static_cast<at::BFloat16>(sum);
    }
  }
}
#endif

// Row-major C (m×n) = A (m×k) · Bᵀ with B stored n×k: the column-major Cᵀ = B Aᵀ. bfloat16 goes through ATen's
// matmul (oneDNN: fp32 accumulation, the CPU's bf16 instructions where it has them), as F.linear would, or for
// a few rows on a CPU with AVX512-BF16 through matmul_bt_bf16_rows.
template <typename T>
inline void matmul_bt(int64_t m, int64_t n, int64_t k, const T* A, const T* B, T* C) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512BF16__)
    if (m <= BF16_DIRECT_ROWS) return matmul_bt_bf16_rows(m, n, k, A, B, C);
#endif
    const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
    at::Tensor c = at::from_blob(C, {m, n}, bf16);
    at::mm_out(c, at::from_blob(const_cast<T*>(A), {m, k}, bf16), at::from_blob(const_cast<T*>(B), {n, k}, bf16).t());
  } else {
    k3_blas::mm<T>(false, true, m, n, k, T(1), A, k, B, k, T(0), C, n);
  }
}

// The type sums are kept in: float for bfloat16 values, else the values' own.
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, at::BFloat16>, float, T>;

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

// The routing's checks, in `op`'s name: z (T, L) in one of `dtypes`, experts (T, K) int64 ids below E, weights
// (T, K) in z's dtype, act "situ" or "silu".
inline void check_routing(const at::Tensor& z, const at::Tensor& experts, const at::Tensor& weights, int64_t E,
                          const std::string& act, const char* op, bool bf16 = false) {
  const auto dt = z.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || (bf16 && dt == at::kBFloat16), op,
              bf16 ? ": float32, float64 or bfloat16 inputs, got " : ": float32 or float64 inputs, got ", dt);
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
  if (gate.scalar_type() == at::kBFloat16)  // computed in fp32 and rounded once, as situ.py does
    return activation(gate.to(at::kFloat), up.to(at::kFloat), situ, beta1, beta2).to(at::kBFloat16);
  if (!situ) return at::silu(gate).mul_(up);
  auto t1 = at::mul(gate, 1.0 / beta1).tanh_(), s = at::sigmoid(gate), t2 = at::mul(up, 1.0 / beta2).tanh_();
  return at::addcmul(at::zeros({}, gate.options()), t1, s, beta1 * beta2).mul_(t2);
}

// out (T, L): row t = Σ_k weights[t·K + k] · h[slot[t·K + k]], added in ascending sorted position (expert order),
// in Acc<T>.
template <typename T>
void combine(const Sorted& s, const T* h, const T* weights, int64_t T_, int64_t K, int64_t L, T* out) {
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> mine(K);
    std::vector<Acc<T>> row(L);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < K; ++k) mine[k] = {s.slot[t * K + k], t * K + k};
      std::sort(mine.begin(), mine.end());
      std::fill(row.begin(), row.end(), Acc<T>(0));
      for (const auto& [pos, a] : mine) {
        const Acc<T> w = weights[a];
        const T* hr = h + pos * L;
        for (int64_t c = 0; c < L; ++c) row[c] += static_cast<Acc<T>>(hr[c]) * w;
      }
      std::copy(row.begin(), row.end(), out + t * L);
    }
  });
}

}  // namespace k3_moe
