// The routed experts of a serving step computed from MXFP4-packed weights, as the release stores them: the
// operator k3_cpu::moe_experts_mxfp4. The reference (LatentMoE.experts_forward with k3.quant.MXFP4Linear experts)
// dequantises every active expert's three weights into fresh fp32 tensors per call, ~30 ATen ops and 4 bytes
// written per weight; here the packed bytes are read where they lie:
//
// - a few rows per expert (decoding): each 32-weight block is decoded in registers (E2M1 codes through a 16-entry
//   table, times the block's E8M0 scale) and multiplied into every row at once, so the weight is read once, at
//   half a byte per value plus a scale byte per 32;
// - more rows (prefill): 64-row tiles of the weight are decoded into a scratch buffer that stays in cache, each
//   multiplied by BLAS.
//
// With quantize_inputs (the config's expert_quantization "mxfp4", SPEC §2.8) every expert matmul reads its input
// as MXFP8 E4M3 in blocks of 32 along the reduction, exactly k3.quant.qat.fake_quantize (the same bit arithmetic).
//
// z (T, L); experts, weights (T, K); p1[e], p3[e] (I, L/2) and s1[e], s3[e] (I, L/32) uint8, expert e's gate and
// up projections packed (k3.quant.mx.pack_mxfp4: column 2j in byte j's low nibble); p2[e] (L, I/2), s2[e]
// (L, I/32) its down projection. Returns u (T, L).

#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "moe_dispatch.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;        // MX block: values per scale byte
constexpr int64_t DIRECT_ROWS = 16;  // up to this many rows an expert's weight is decoded in registers
constexpr int64_t TILE_ROWS = 64;    // weight rows decoded per scratch tile above that

// Bits of a float type, for the E4M3 quantiser (k3.quant.qat.FLOAT_BITS).
template <typename T>
struct Bits;
template <>
struct Bits<float> {
  using Int = int32_t;
  static constexpr int mantissa = 23, bias = 127;
};
template <>
struct Bits<double> {
  using Int = int64_t;
  static constexpr int mantissa = 52, bias = 1023;
};

template <typename T>
inline T from_bits(typename Bits<T>::Int i) {
  T v;
  std::memcpy(&v, &i, sizeof v);
  return v;
}

template <typename T>
inline typename Bits<T>::Int to_bits(T v) {
  typename Bits<T>::Int i;
  std::memcpy(&i, &v, sizeof v);
  return i;
}

// The E2M1 value of each code (sign bit 3, exponent bits 2..1, mantissa bit 0), and 2^(s − 127) of each E8M0
// scale byte (NaN for 0xFF), both exact in T.
template <typename T>
struct Tables {
  T e2m1[16], e8m0[256];
  Tables() {
    const double magnitude[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
    for (int c = 0; c < 16; ++c) e2m1[c] = static_cast<T>(c & 8 ? -magnitude[c & 7] : magnitude[c & 7]);
    for (int s = 0; s < 256; ++s) e8m0[s] = s == 255 ? static_cast<T>(NAN) : static_cast<T>(std::ldexp(1.0, s - 127));
  }
};

template <typename T>
const Tables<T>& tables() {
  static const Tables<T> t;
  return t;
}

// MXFP8 E4M3 quantise-dequantise of n values (n a multiple of 32), k3.quant.qat.fake_quantize's arithmetic: the
// block's shared exponent from amax's bits, values scaled by 2^-shared, saturated to 448, rounded to the element
// grid by adding and subtracting 2^(binade + mantissa − 3), scaled back. A NaN or ±inf makes its block NaN.
template <typename T>
void fake_quantize_e4m3(const T* x, T* y, int64_t n) {
  using Int = typename Bits<T>::Int;
  constexpr int M = Bits<T>::mantissa, bias = Bits<T>::bias, emax = 8, emin = -6, m = 3;
  constexpr T max = 448;
  for (int64_t b = 0; b < n; b += BLOCK) {
    T amax = 0;
    bool finite = true;
    for (int64_t i = 0; i < BLOCK; ++i) {
      const T a = std::abs(x[b + i]);
      finite = finite && std::isfinite(a);
      amax = a > amax ? a : amax;
    }
    if (!finite) {
      for (int64_t i = 0; i < BLOCK; ++i) y[b + i] = static_cast<T>(NAN);
      continue;
    }
    Int shared = (to_bits(amax) >> M) - (bias + emax);
    shared = shared < -127 ? -127 : (shared > 127 ? 127 : shared);
    const T inverse = from_bits<T>(static_cast<Int>(bias - shared) << M);
    const T scale = from_bits<T>(shared > -bias ? static_cast<Int>(shared + bias) << M : Int(1) << (M - 1));
    for (int64_t i = 0; i < BLOCK; ++i) {
      T a = std::abs(x[b + i]) * inverse;
      a = a > max ? max : a;
      Int binade = to_bits(a) >> M;
      binade = binade < emin + bias ? emin + bias : binade;
      const T magic = from_bits<T>(static_cast<Int>(binade + (M - m)) << M);
      y[b + i] = std::copysign((a + magic) - magic, x[b + i]) * scale;
    }
  }
}

// One packed weight row (k values: k/2 bytes, k/32 scales) decoded into w (k values).
template <typename T>
inline void decode_row(const uint8_t* p, const uint8_t* s, int64_t k, T* w) {
  const Tables<T>& tab = tables<T>();
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 lut = _mm512_loadu_ps(tab.e2m1);
    // interleave the low (even column) and high (odd column) nibbles' values back into column order
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t b = 0; b < k / BLOCK; ++b) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * 16)));
      const __m512 scale = _mm512_set1_ps(tab.e8m0[s[b]]);
      const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), lut), scale);
      const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut), scale);
      _mm512_storeu_ps(w + b * BLOCK, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(w + b * BLOCK + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
    return;
  }
#endif
  for (int64_t b = 0; b < k / BLOCK; ++b) {
    const T scale = tab.e8m0[s[b]];
    for (int64_t j = 0; j < BLOCK / 2; ++j) {
      const uint8_t byte = p[b * 16 + j];
      w[b * BLOCK + 2 * j] = tab.e2m1[byte & 15] * scale;
      w[b * BLOCK + 2 * j + 1] = tab.e2m1[byte >> 4] * scale;
    }
  }
}

// C (m×n) = X (m×k) · Wᵀ for m ≤ DIRECT_ROWS, W (n×k) packed: each weight block decoded once, in registers, and
// multiplied into every row. x_even / x_odd are X's even and odd columns (m × k/2 each), matching the nibbles.
template <typename T>
void direct_rows(int64_t m, int64_t n, int64_t k, const T* x_even, const T* x_odd, const uint8_t* P, const uint8_t* S,
                 T* C) {
  const Tables<T>& tab = tables<T>();
  const int64_t half = k / 2;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 lut = _mm512_loadu_ps(tab.e2m1);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* p = P + j * half;
      const uint8_t* s = S + j * (k / BLOCK);
      __m512 acc[DIRECT_ROWS];
      for (int64_t r = 0; r < m; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < k / BLOCK; ++b) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * 16)));
        const __m512 scale = _mm512_set1_ps(tab.e8m0[s[b]]);
        const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), lut), scale);
        const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut), scale);
        for (int64_t r = 0; r < m; ++r) {
          acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x_even + r * half + b * 16), acc[r]);
          acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x_odd + r * half + b * 16), acc[r]);
        }
      }
      for (int64_t r = 0; r < m; ++r) C[r * n + j] = _mm512_reduce_add_ps(acc[r]);
    }
    return;
  }
#endif
  // portable: 16 independent lanes per row (vectorisable without reassociating a sum), added up at the row's end
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* p = P + j * half;
    const uint8_t* s = S + j * (k / BLOCK);
    T acc[DIRECT_ROWS][16] = {};
    for (int64_t b = 0; b < k / BLOCK; ++b) {
      const T scale = tab.e8m0[s[b]];
      T lo[16], hi[16];
      for (int64_t i = 0; i < 16; ++i) {
        lo[i] = tab.e2m1[p[b * 16 + i] & 15] * scale;
        hi[i] = tab.e2m1[p[b * 16 + i] >> 4] * scale;
      }
      for (int64_t r = 0; r < m; ++r) {
        const T* xe = x_even + r * half + b * 16;
        const T* xo = x_odd + r * half + b * 16;
        for (int64_t i = 0; i < 16; ++i) acc[r][i] += lo[i] * xe[i] + hi[i] * xo[i];
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      T sum = 0;
      for (int64_t i = 0; i < 16; ++i) sum += acc[r][i];
      C[r * n + j] = sum;
    }
  }
}

// C (m×n) = X (m×k) · Wᵀ, W (n×k) given as packed bytes P (n × k/2) and scales S (n × k/32).
template <typename T>
void packed_matmul_bt(int64_t m, int64_t n, int64_t k, const T* X, const uint8_t* P, const uint8_t* S, T* C,
                      std::vector<T>& scratch) {
  if (m <= DIRECT_ROWS) {
    scratch.resize(m * k);
    T* even = scratch.data();
    T* odd = even + m * k / 2;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < k / 2; ++c)
        even[r * k / 2 + c] = X[r * k + 2 * c], odd[r * k / 2 + c] = X[r * k + 2 * c + 1];
    direct_rows<T>(m, n, k, even, odd, P, S, C);
    return;
  }
  scratch.resize(TILE_ROWS * k);
  std::vector<T> part(m * TILE_ROWS);
  for (int64_t j0 = 0; j0 < n; j0 += TILE_ROWS) {
    const int64_t rows = std::min(TILE_ROWS, n - j0);
    for (int64_t j = 0; j < rows; ++j)
      decode_row<T>(P + (j0 + j) * (k / 2), S + (j0 + j) * (k / BLOCK), k, scratch.data() + j * k);
    k3_moe::matmul_bt<T>(m, rows, k, X, scratch.data(), part.data());
    for (int64_t r = 0; r < m; ++r) std::copy_n(part.data() + r * rows, rows, C + r * n + j0);
  }
}

struct Packed {
  const uint8_t* bytes;
  const uint8_t* scales;
};

template <typename T>
void experts(const at::Tensor& z, const at::Tensor& experts_tk, const at::Tensor& weights_tk,
             const std::vector<Packed>& w1, const std::vector<Packed>& w3, const std::vector<Packed>& w2, int64_t I,
             bool situ, double beta1, double beta2, bool quantize_inputs, at::Tensor& out) {
  const int64_t T_ = z.size(0), L = z.size(1), K = experts_tk.size(1), E = static_cast<int64_t>(w1.size()), A = T_ * K;
  const k3_moe::Sorted s = k3_moe::sort_by_expert(experts_tk.data_ptr<int64_t>(), A, E);
  const auto& start = s.start;
  const int64_t n_active = static_cast<int64_t>(s.active.size());
  // the expert inputs, quantised once per token (a row's blocks do not depend on which rows share the call)
  at::Tensor zq = z;
  if (quantize_inputs) {
    zq = at::empty_like(z);
    at::parallel_for(0, T_, 8, [&](int64_t b, int64_t e) {
      fake_quantize_e4m3<T>(z.data_ptr<T>() + b * L, zq.data_ptr<T>() + b * L, (e - b) * L);
    });
  }
  const T* zp = zq.data_ptr<T>();
  auto gate = at::empty({A, I}, z.options()), up = at::empty({A, I}, z.options());
  T* gp = gate.data_ptr<T>();
  T* upp = up.data_ptr<T>();
  at::parallel_for(0, n_active, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> zb, scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = s.active[i], n = start[e + 1] - start[e];
      zb.resize(n * L);
      for (int64_t r = 0; r < n; ++r) std::copy_n(zp + (s.order[start[e] + r] / K) * L, L, zb.data() + r * L);
      packed_matmul_bt<T>(n, I, L, zb.data(), w1[e].bytes, w1[e].scales, gp + start[e] * I, scratch);
      packed_matmul_bt<T>(n, I, L, zb.data(), w3[e].bytes, w3[e].scales, upp + start[e] * I, scratch);
    }
  });
  at::Tensor act = k3_moe::activation(gate, up, situ, beta1, beta2);
  if (quantize_inputs) {
    T* ap = act.data_ptr<T>();
    at::parallel_for(0, A, 8,
                     [&](int64_t b, int64_t e) { fake_quantize_e4m3<T>(ap + b * I, ap + b * I, (e - b) * I); });
  }
  const T* ap = act.data_ptr<T>();
  std::vector<T> h(A * L);
  at::parallel_for(0, n_active, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = s.active[i], n = start[e + 1] - start[e];
      packed_matmul_bt<T>(n, L, I, ap + start[e] * I, w2[e].bytes, w2[e].scales, h.data() + start[e] * L, scratch);
    }
  });
  k3_moe::combine<T>(s, h.data(), weights_tk.data_ptr<T>(), T_, K, L, out.data_ptr<T>());
}

std::vector<Packed> packed_weights(at::TensorList bytes, at::TensorList scales, int64_t out, int64_t in,
                                   const char* name) {
  std::vector<Packed> w;
  for (size_t e = 0; e < bytes.size(); ++e) {
    const auto &p = bytes[e], &s = scales[e];
    TORCH_CHECK(p.scalar_type() == at::kByte && s.scalar_type() == at::kByte && p.is_contiguous() &&
                    s.is_contiguous() && p.sizes() == at::IntArrayRef({out, in / 2}) &&
                    s.sizes() == at::IntArrayRef({out, in / BLOCK}),
                "moe_experts_mxfp4: expert ", e, "'s ", name, " must be contiguous uint8 bytes (", out, ", ", in / 2,
                ") and scales (", out, ", ", in / BLOCK, ")");
    w.push_back({p.data_ptr<uint8_t>(), s.data_ptr<uint8_t>()});
  }
  return w;
}

at::Tensor moe_experts_mxfp4(const at::Tensor& z_in, const at::Tensor& experts_in, const at::Tensor& weights_in,
                             at::TensorList p1, at::TensorList s1, at::TensorList p3, at::TensorList s3,
                             at::TensorList p2, at::TensorList s2, std::string act, double beta1, double beta2,
                             bool quantize_inputs) {
  const at::Tensor z = z_in.contiguous(), experts_tk = experts_in.contiguous(), weights_tk = weights_in.contiguous();
  const int64_t E = static_cast<int64_t>(p1.size());
  TORCH_CHECK(E > 0 && static_cast<int64_t>(s1.size()) == E && static_cast<int64_t>(p3.size()) == E &&
                  static_cast<int64_t>(s3.size()) == E && static_cast<int64_t>(p2.size()) == E &&
                  static_cast<int64_t>(s2.size()) == E,
              "moe_experts_mxfp4: p1, s1, p3, s3, p2, s2 must hold one tensor per expert each");
  k3_moe::check_routing(z, experts_tk, weights_tk, E, act, "moe_experts_mxfp4");
  const int64_t L = z.size(1), I = p1[0].size(0);
  TORCH_CHECK(L % BLOCK == 0 && I % BLOCK == 0, "moe_experts_mxfp4: the latent width ", L, " and expert width ", I,
              " must be multiples of ", BLOCK);
  const auto w1 = packed_weights(p1, s1, I, L, "w1"), w3 = packed_weights(p3, s3, I, L, "w3");
  const auto w2 = packed_weights(p2, s2, L, I, "w2");
  auto out = at::empty_like(z);
  if (z.size(0) == 0) return out;
  if (z.scalar_type() == at::kFloat)
    experts<float>(z, experts_tk, weights_tk, w1, w3, w2, I, act == "situ", beta1, beta2, quantize_inputs, out);
  else
    experts<double>(z, experts_tk, weights_tk, w1, w3, w2, I, act == "situ", beta1, beta2, quantize_inputs, out);
  return out;
}

// A compiled serving step names a layer's packed experts by a number instead of taking its 6·E tensors as graph
// inputs (each input costs the graph's caller a few µs per call): set_packed_experts keeps the tensors under
// the layer's handle (k3.model.moe.LatentMoE.handle) until drop_packed_experts, and moe_experts_mxfp4_layer
// computes with them.
struct Layer {
  std::vector<at::Tensor> p1, s1, p3, s3, p2, s2;
};
std::mutex layers_lock;
std::unordered_map<int64_t, std::shared_ptr<const Layer>> layers;

void set_packed_experts(int64_t handle, at::TensorList p1, at::TensorList s1, at::TensorList p3, at::TensorList s3,
                        at::TensorList p2, at::TensorList s2) {
  const auto list = [](at::TensorList t) { return std::vector<at::Tensor>(t.begin(), t.end()); };
  auto layer = std::make_shared<const Layer>(Layer{list(p1), list(s1), list(p3), list(s3), list(p2), list(s2)});
  std::lock_guard<std::mutex> guard(layers_lock);
  layers[handle] = std::move(layer);
}

void drop_packed_experts(int64_t handle) {
  std::lock_guard<std::mutex> guard(layers_lock);
  layers.erase(handle);
}

at::Tensor moe_experts_mxfp4_layer(const at::Tensor& z, const at::Tensor& experts, const at::Tensor& weights,
                                   int64_t handle, std::string act, double beta1, double beta2, bool quantize_inputs) {
  std::shared_ptr<const Layer> layer;
  {
    std::lock_guard<std::mutex> guard(layers_lock);
    const auto found = layers.find(handle);
    TORCH_CHECK(found != layers.end(), "moe_experts_mxfp4_layer: no packed experts are set for layer handle ", handle);
    layer = found->second;
  }
  return moe_experts_mxfp4(z, experts, weights, layer->p1, layer->s1, layer->p3, layer->s3, layer->p2, layer->s2, act,
                           beta1, beta2, quantize_inputs);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3_cpu, m) {
  m.def(
      "moe_experts_mxfp4(Tensor z, Tensor experts, Tensor weights, Tensor[] p1, Tensor[] s1, Tensor[] p3, "
      "Tensor[] s3, Tensor[] p2, Tensor[] s2, str act, float beta1, float beta2, bool quantize_inputs) -> Tensor");
  m.def(
      "moe_experts_mxfp4_layer(Tensor z, Tensor experts, Tensor weights, int handle, str act, float beta1, "
      "float beta2, bool quantize_inputs) -> Tensor");
  m.def(
      "set_packed_experts(int handle, Tensor[] p1, Tensor[] s1, Tensor[] p3, Tensor[] s3, Tensor[] p2, Tensor[] s2) -> "
      "()");
  m.def("drop_packed_experts(int handle) -> ()");
}

TORCH_LIBRARY_IMPL(k3_cpu, CPU, m) {
  m.impl("moe_experts_mxfp4", &moe_experts_mxfp4);
  m.impl("moe_experts_mxfp4_layer", &moe_experts_mxfp4_layer);
}

// no tensor argument to dispatch on: registered for every backend
TORCH_LIBRARY_IMPL(k3_cpu, CatchAll, m) {
  m.impl("set_packed_experts", &set_packed_experts);
  m.impl("drop_packed_experts", &drop_packed_experts);
}
