// BLAS for k3's C++ kernels (chunk_kda_cpu.cpp, the routed experts'): the Fortran sgemm/dgemm that torch's x86
// wheels carry (MKL, LP64; a build without them fails to load, and k3 falls back to its PyTorch paths), and a
// row-major product over them.
#pragma once

#include <cstdint>
#include <type_traits>

namespace k3_blas {

extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

// Row-major C (m×n) = alpha·op(A) op(B) + beta·C; op(A) is m×k (A stored k×m when ta), op(B) k×n.
// BLAS is column-major: the row-major product is the column-major Cᵀ = op(B)ᵀ op(A)ᵀ.
template <typename T>
inline void mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* A, int64_t lda, const T* B,
               int64_t ldb, T beta, T* C, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const char ca = tb ? 'T' : 'N', cb = ta ? 'T' : 'N';
  const int im = static_cast<int>(n), in = static_cast<int>(m), ik = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  if constexpr (std::is_same_v<T, float>)
    sgemm_(&ca, &cb, &im, &in, &ik, &alpha, B, &la, A, &lb, &beta, C, &lc);
  else
    dgemm_(&ca, &cb, &im, &in, &ik, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

}  // namespace k3_blas
