// Chunked KDA on the CPU, forward and backward, as two torch.library operators (k3_kda::chunk_fwd,
// k3_kda::chunk_bwd). The algorithm is chunk.py / chunk_bwd.py's (the reference beside it); what changes is
// where the work happens: every chunk's element-wise passes run over that chunk's rows while they are in
// cache, the small matmuls go straight to BLAS (the sgemm_/dgemm_ that torch's CPU build links and exports; no
// dispatcher per call), and the
// parallel loops are at::parallel_for over (head, chunk) or over heads for the state recursion.
//
// Layouts: q, k, g (B, T, H, K), v (B, T, H, V), beta (B, T, H), contiguous, T a multiple of the chunk size C
// (the caller pads with neutral zeros). A chunk's rows of one head are strided by H·K (H·V), which BLAS reads
// directly as the leading dimension; nothing is transposed into a chunk layout.
//
// The decay e^{G_t − G_s} inside a chunk (G the in-chunk cumulative log-decay, falling along the chunk) is
// split at a pivot between s and t so both factors are ≤ 1 and nothing overflows: the chunk's rows are taken
// in blocks of BS = 16 tokens, each pivoted at its first token p, so the columns before the block are one
// matmul of (x_t e^{G_t − G_p}) against (y_s e^{G_p − G_s}); pairs inside a block are summed exactly, with one
// exponential per pair and channel. Every exponent is floored at 0.35·ln(smallest normal) (−30.6 in fp32):
// a factor below it stands for one below the dtype's resolution, and no factor, product or sum is then
// subnormal (x86 BLAS kernels run 10-70× slower on subnormal operands). decay.py explains the floor.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../csrc/blas.h"

namespace {

constexpr int64_t BS = 16;  // the row block: pivoted matmuls before it, exact pairs inside it

using k3_blas::mm;

template <typename T>
inline T floor_ln() {  // the smallest exponent a decay factor keeps: 0.35·ln(smallest normal)
  return T(0.35) * std::log(std::numeric_limits<T>::min());
}

// e^x for floor_ln ≤ x ≤ 80: Cody–Waite reduction and a degree-7 Taylor polynomial (|f| ≤ ln2/2, error
// 1–2 fp32 ulp), written so that GCC vectorises it inside the channel loops.
inline float exp_f(float x) {
  const float r = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  const float f = (x - r * 0.693145751953125f) - r * 1.428606765330187e-06f;
  const float p =
      1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 +
                                          f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720 + f * (1.0f / 5040)))))));
  const int32_t bits = (static_cast<int32_t>(r) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
inline double exp_f(double x) { return std::exp(x); }

template <typename T>
inline T floored_exp(T x, T fl) {
  return exp_f(x < fl ? fl : x);
}

template <typename T>
inline void flush(T* x, int64_t n, T tiny) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::abs(x[i]) < tiny ? T(0) : x[i];
}

struct Shape {
  int64_t B, T, H, K, V, C, NC;
  int64_t BH() const { return B * H; }
};

// One chunk's inputs for one head: row t of q is q[t * sk].
template <typename T>
struct Rows {
  const T *q, *k, *v, *g, *beta;
  int64_t sk, sv, sb;
};

template <typename T>
Rows<T> rows_of(const Shape& d, const T* q, const T* k, const T* v, const T* g, const T* beta, int64_t bh, int64_t n) {
  const int64_t b = bh / d.H, h = bh % d.H, t0 = b * d.T + n * d.C;
  return {q + (t0 * d.H + h) * d.K,
          k + (t0 * d.H + h) * d.K,
          v + (t0 * d.H + h) * d.V,
          g + (t0 * d.H + h) * d.K,
          beta + t0 * d.H + h,
          d.H * d.K,
          d.H * d.V,
          d.H};
}

// Everything of one chunk that does not depend on its start state (chunk_terms.py's ChunkTerms), in fp32/fp64
// scratch owned by the caller. The forward keeps U, W, Aqk, qG, kd and gend; the backward reads all of it.
template <typename T>
struct Terms {
  T *qs, *kc, *G, *gam, *kG, *qG, *to_end, *kd;  // (C, K): q·scale, k, G, Γ = e^G, kΓ, q·scale·Γ, Γ_C/Γ, kΓ_C/Γ
  T* eg;                                         // (C, K): e^g, each token's own decay
  T *Akk, *Aqk, *M;                              // (C, C): strictly lower Akk, lower Aqk, (I + βAkk)⁻¹
  T *U, *W;                                      // (C, V) M βv, (C, K) M βkΓ
  T* gend;                                       // (K) Γ_C
  T* beta;                                       // (C) β
  static int64_t size(int64_t C, int64_t K, int64_t V) { return 10 * C * K + 3 * C * C + C * V + K + C; }
  static Terms at(T* p, int64_t C, int64_t K, int64_t V) {
    Terms t;
    for (T** f : {&t.qs, &t.kc, &t.G, &t.gam, &t.kG, &t.qG, &t.to_end, &t.kd, &t.eg}) *f = p, p += C * K;
    for (T** f : {&t.Akk, &t.Aqk, &t.M}) *f = p, p += C * C;
    t.U = p, p += C * V;
    t.W = p, p += C * K;
    t.gend = p, p += K;
    t.beta = p;
    return t;
  }
};

// A buffer of at least n elements that lives as long as the thread: the kernel's temporaries would otherwise be
// fresh pages on every call (page faults and zeroing measured ~5% of the backward). slot: which of the thread's.
template <typename T>
T* workspace(int slot, int64_t n) {
  thread_local std::vector<T> buffers[4];
  auto& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < n) b.resize(n);
  return b.data();
}

// Per-thread scratch for the pivoted products: the row block's factors, the columns' factors and operands.
template <typename T>
struct Scratch {
  T *a, *b, *y, *x, *tmp, *tmp2, *f;
  Scratch(int64_t C, int64_t K) {
    T* p = workspace<T>(3, BS * K + 2 * C * K + 2 * BS * K + C * std::max(C, K) + C * C + K);
    a = p, b = a + BS * K, y = b + C * K, x = y + C * K, tmp = x + 2 * BS * K, tmp2 = tmp + C * std::max(C, K);
    f = tmp2 + C * C;
  }
};

// The pivot factors of row block [r0, r0 + BS): a_t = e^{G_t − G_r0} for its rows, b_s = e^{G_r0 − G_s} for s < r0.
template <typename T>
void block_factors(const T* G, int64_t r0, int64_t K, T fl, T* a, T* b) {
  const T* p = G + r0 * K;
  for (int64_t t = 0; t < BS; ++t) {
    const T* Gt = G + (r0 + t) * K;
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) a[t * K + c] = floored_exp(Gt[c] - p[c], fl);
  }
  for (int64_t s = 0; s < r0; ++s) {
    const T* Gs = G + s * K;
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) b[s * K + c] = floored_exp(p[c] - Gs[c], fl);
  }
}

// chunk_terms for one chunk of one head.
template <typename T>
__attribute__((noinline)) void chunk_terms(const Rows<T>& in, T scale, int64_t C, int64_t K, int64_t V,
                                           const Terms<T>& t, Scratch<T>& w) {
  const T fl = floor_ln<T>();
  const T tiny = exp_f(fl);
  for (int64_t r = 0; r < C; ++r) {
    const T *q = in.q + r * in.sk, *k = in.k + r * in.sk, *g = in.g + r * in.sk;
    T *qs = t.qs + r * K, *kc = t.kc + r * K, *G = t.G + r * K, *eg = t.eg + r * K;
    const T* Gp = r ? G - K : nullptr;
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) {
      qs[c] = q[c] * scale;
      kc[c] = k[c];
      G[c] = (r ? Gp[c] : T(0)) + g[c];
      eg[c] = floored_exp(g[c], fl);
    }
    t.beta[r] = in.beta[r * in.sb];
  }
  const T* Gl = t.G + (C - 1) * K;
  for (int64_t r = 0; r < C; ++r) {
    const T *G = t.G + r * K, *kc = t.kc + r * K, *qs = t.qs + r * K;
    T *gam = t.gam + r * K, *kG = t.kG + r * K, *qG = t.qG + r * K, *te = t.to_end + r * K, *kd = t.kd + r * K;
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) {
      gam[c] = floored_exp(G[c], fl);
      kG[c] = kc[c] * gam[c];
      qG[c] = qs[c] * gam[c];
      te[c] = floored_exp(Gl[c] - G[c], fl);
      kd[c] = kc[c] * te[c];
    }
  }
  std::copy(t.gam + (C - 1) * K, t.gam + C * K, t.gend);

  // Akk_ts = Σ_c k_tc k_sc e^{G_tc − G_sc} (s < t), Aqk likewise with q·scale (s ≤ t)
  std::fill(t.Akk, t.Akk + C * C, T(0));
  std::fill(t.Aqk, t.Aqk + C * C, T(0));
  for (int64_t r0 = 0; r0 < C; r0 += BS) {
    if (r0 > 0) {
      block_factors(t.G, r0, K, fl, w.a, w.b);
      for (int64_t i = 0; i < BS; ++i) {
        const T *a = w.a + i * K, *kc = t.kc + (r0 + i) * K, *qs = t.qs + (r0 + i) * K;
        T *xk = w.x + i * K, *xq = w.x + (BS + i) * K;
#pragma omp simd
        for (int64_t c = 0; c < K; ++c) xk[c] = kc[c] * a[c], xq[c] = qs[c] * a[c];
      }
      for (int64_t s = 0; s < r0 * K; ++s) w.y[s] = t.kc[s] * w.b[s];
      mm<T>(false, true, BS, r0, K, 1, w.x, K, w.y, K, 0, t.Akk + r0 * C, C);
      mm<T>(false, true, BS, r0, K, 1, w.x + BS * K, K, w.y, K, 0, t.Aqk + r0 * C, C);
    }
    // inside the block, e^{G_t − G_s} = max(e^{G_t − G_{s+1}} · e^{g_{s+1}}, floor) walking s down from t: one
    // multiply a pair and channel instead of an exponential (each factor ≤ 1 and floored, so no product is subnormal)
    for (int64_t tt = r0; tt < r0 + BS; ++tt) {
      const T *kt = t.kc + tt * K, *qt = t.qs + tt * K;
      T* f = w.f;
      std::fill_n(f, K, T(1));
      for (int64_t s = tt - 1; s >= r0; --s) {
        const T *e = t.eg + (s + 1) * K, *ks = t.kc + s * K;
        T akk = 0, aqk = 0;
#pragma omp simd reduction(+ : akk, aqk)
        for (int64_t c = 0; c < K; ++c) {
          const T fc = std::max(f[c] * e[c], tiny);
          f[c] = fc;
          akk += kt[c] * ks[c] * fc;
          aqk += qt[c] * ks[c] * fc;
        }
        t.Akk[tt * C + s] = akk;
        t.Aqk[tt * C + s] = aqk;
      }
      T diag = 0;
#pragma omp simd reduction(+ : diag)
      for (int64_t c = 0; c < K; ++c) diag += qt[c] * kt[c];
      t.Aqk[tt * C + tt] = diag;
    }
  }

  // M = (I + L)⁻¹, L = diag(β) Akk flushed, by forward substitution; every row flushed (its entries are sums over
  // chains of L's entries, which for a steep gate fall through the subnormal range)
  T* L = w.tmp2;
  for (int64_t i = 0; i < C * C; ++i) L[i] = t.Akk[i] * t.beta[i / C];
  flush(L, C * C, tiny);
  std::fill(t.M, t.M + C * C, T(0));
  for (int64_t r = 0; r < C; ++r) {
    T* Mr = t.M + r * C;
    for (int64_t j = 0; j < r; ++j) {
      const T l = L[r * C + j];
      if (l == T(0)) continue;
      const T* Mj = t.M + j * C;
#pragma omp simd
      for (int64_t s = 0; s <= j; ++s) Mr[s] -= l * Mj[s];
    }
    flush(Mr, r, tiny);
    Mr[r] = 1;
  }
  // U = M diag(β) v, W = M diag(β) kΓ
  T* Tinv = w.tmp2;
  for (int64_t i = 0; i < C * C; ++i) Tinv[i] = t.M[i] * t.beta[i % C];
  mm<T>(false, false, C, V, C, 1, Tinv, C, in.v, in.sv, 0, t.U, V);
  mm<T>(false, false, C, K, C, 1, Tinv, C, t.kG, K, 0, t.W, K);
}

// The chunk's first and last: which sequence (if any) starts or ends at chunk n of head bh.
struct Sequences {
  const int64_t *first, *last;  // packed: per chunk, the sequence starting / ending there, or −1
  int64_t NC, H;
  int64_t starts(int64_t bh, int64_t n) const { return first ? first[n] : (n == 0 ? bh / H : -1); }
  int64_t ends(int64_t bh, int64_t n) const { return last ? last[n] : (n == NC - 1 ? bh / H : -1); }
};

int64_t group_chunks(const Shape& d) {
  // chunks per group: the group's terms stay near 2^20 elements (a few MB), as chunk_terms.py's groups
  const int64_t per_chunk = d.BH() * (9 * d.C * d.K + 3 * d.C * d.C + 2 * d.C * d.V + 2 * d.K * d.V);
  return std::max<int64_t>(1, (int64_t(1) << 20) / per_chunk);
}

// Whether each thread can take whole heads, every chunk of them in order: no barrier between the chunk-parallel
// terms and the recursion, and each chunk's terms used while in cache. Otherwise (fewer heads than threads, or an
// uneven split) chunks are taken in groups, their terms in parallel over (head, chunk), then the recursion by head.
bool by_head(const Shape& d) {
  const int64_t threads = at::get_num_threads();
  return d.BH() % threads == 0 || d.BH() >= 4 * threads;
}

// One chunk of the forward, given its terms: the state entering it is saved to Sn, u = U − W S (in place on U),
// the state carried on, S ← Γ_C S + kdᵀ u. The sequence bookkeeping around it is the caller's.
template <typename T>
void forward_state_step(const Terms<T>& t, int64_t C, int64_t K, int64_t V, T* S, T* Sn) {
  std::copy_n(S, K * V, Sn);
  mm<T>(false, false, C, V, K, -1, t.W, K, S, V, 1, t.U, V);
  for (int64_t c = 0; c < K; ++c) {
    const T gc = t.gend[c];
#pragma omp simd
    for (int64_t x = 0; x < V; ++x) S[c * V + x] *= gc;
  }
  mm<T>(true, false, K, V, C, 1, t.kd, K, t.U, V, 1, S, V);
}

// o = (qΓ) Sn + Aqk u for one chunk, straight into the (B, T, H, V) output (row stride ldo).
template <typename T>
void forward_output(const Terms<T>& t, int64_t C, int64_t K, int64_t V, const T* Sn, T* out, int64_t ldo) {
  mm<T>(false, false, C, V, K, 1, t.qG, K, Sn, V, 0, out, ldo);
  mm<T>(false, false, C, V, C, 1, t.Aqk, C, t.U, V, 1, out, ldo);
}

template <typename T>
void forward(const Shape& d, const T* q, const T* k, const T* v, const T* g, const T* beta, T scale, const T* h0,
             const Sequences& seqs, T* o, T* final, T* starts) {
  const int64_t C = d.C, K = d.K, V = d.V, KV = K * V, BH = d.BH(), tsize = Terms<T>::size(C, K, V);
  auto enter = [&](int64_t bh, int64_t n, T* S) {  // a sequence starting at chunk n: its initial state, or zeros
    const int64_t seq = seqs.starts(bh, n);
    if (seq < 0) return;
    if (h0)
      std::copy_n(h0 + (seq * d.H + bh % d.H) * KV, KV, S);
    else
      std::fill_n(S, KV, T(0));
  };
  auto leave = [&](int64_t bh, int64_t n, const T* S) {
    const int64_t seq = seqs.ends(bh, n);
    if (seq >= 0) std::copy_n(S, KV, final + (seq * d.H + bh % d.H) * KV);
  };
  auto out_at = [&](int64_t bh, int64_t n) { return o + ((bh / d.H * d.T + n * C) * d.H + bh % d.H) * V; };
  if (by_head(d)) {
    at::parallel_for(0, BH, 1, [&](int64_t lo, int64_t hi) {
      Scratch<T> w(C, K);
      const Terms<T> t = Terms<T>::at(workspace<T>(0, tsize + 2 * KV), C, K, V);
      T *S = t.beta + C, *local = S + KV;
      for (int64_t bh = lo; bh < hi; ++bh) {
        std::fill_n(S, KV, T(0));  // a first chunk that starts no sequence starts from zeros, as the reference
        for (int64_t n = 0; n < d.NC; ++n) {
          chunk_terms(rows_of(d, q, k, v, g, beta, bh, n), scale, C, K, V, t, w);
          enter(bh, n, S);
          T* Sn = starts ? starts + (bh * d.NC + n) * KV : local;
          forward_state_step(t, C, K, V, S, Sn);
          forward_output(t, C, K, V, Sn, out_at(bh, n), d.H * V);
          leave(bh, n, S);
        }
      }
    });
    return;
  }
  const int64_t NG = std::min(d.NC, group_chunks(d));
  T* terms = workspace<T>(0, NG * BH * tsize);
  T* local_starts = workspace<T>(1, starts ? 0 : NG * BH * KV);
  T* state = workspace<T>(2, BH * KV);
  std::fill_n(state, BH * KV, T(0));
  auto terms_at = [&](int64_t bh, int64_t j) { return Terms<T>::at(terms + (bh * NG + j) * tsize, C, K, V); };
  auto start_at = [&](int64_t bh, int64_t n, int64_t j) {
    return starts ? starts + (bh * d.NC + n) * KV : local_starts + (bh * NG + j) * KV;
  };
  for (int64_t c0 = 0; c0 < d.NC; c0 += NG) {
    const int64_t n_g = std::min(NG, d.NC - c0);
    at::parallel_for(0, BH * n_g, 1, [&](int64_t lo, int64_t hi) {
      Scratch<T> w(C, K);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t bh = i / n_g, j = i % n_g;
        chunk_terms(rows_of(d, q, k, v, g, beta, bh, c0 + j), scale, C, K, V, terms_at(bh, j), w);
      }
    });
    at::parallel_for(0, BH, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t bh = lo; bh < hi; ++bh)
        for (int64_t j = 0; j < n_g; ++j) {
          T* S = state + bh * KV;
          enter(bh, c0 + j, S);
          forward_state_step(terms_at(bh, j), C, K, V, S, start_at(bh, c0 + j, j));
          leave(bh, c0 + j, S);
        }
    });
    at::parallel_for(0, BH * n_g, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t bh = i / n_g, j = i % n_g;
        forward_output(terms_at(bh, j), C, K, V, start_at(bh, c0 + j, j), out_at(bh, c0 + j), d.H * V);
      }
    });
  }
}

// The gradients of one chunk's terms (chunk_bwd.py's terms_backward), written into the (B, T, H, ·) gradients.
// dU = du (C, V); dW (C, K); dAqk (C, C) lower; dqd (C, K); dkd (C, K); dgend (K).
template <typename T>
__attribute__((noinline)) void terms_backward(const Rows<T>& in, const Terms<T>& t, T scale, int64_t C, int64_t K,
                                              int64_t V, const T* dU, const T* dW, const T* dAqk, const T* dqd,
                                              const T* dkd, const T* dgend, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                                              int64_t sb, Scratch<T>& w, T* buf) {
  const T fl = floor_ln<T>(), tiny = exp_f(fl);
  T *Tinv = buf, *dTinv = buf + C * C, *X = buf + 2 * C * C, *dL = buf + 3 * C * C, *dAkk = buf + 4 * C * C;
  T *dkG = buf + 5 * C * C, *dqr = dkG + C * K, *dkr = dqr + C * K, *dkc = dkr + C * K, *dG = dkc + C * K;
  T* db = dG + C * K;
  for (int64_t i = 0; i < C * C; ++i) Tinv[i] = t.M[i] * t.beta[i % C];
  mm<T>(true, false, C, V, C, 1, Tinv, C, dU, V, 0, dv, in.sv);
  mm<T>(true, false, C, K, C, 1, Tinv, C, dW, K, 0, dkG, K);
  mm<T>(false, true, C, C, V, 1, dU, V, in.v, in.sv, 0, dTinv, C);
  mm<T>(false, true, C, C, K, 1, dW, K, t.kG, K, 1, dTinv, C);
  // Tinv = M diag(β): column s carries β_s; dM = dTinv diag(β); d(βAkk) = −Mᵀ dM Mᵀ, strictly lower
  for (int64_t s = 0; s < C; ++s) db[s] = 0;
  for (int64_t r = 0; r < C; ++r)
    for (int64_t s = 0; s < C; ++s) {
      db[s] += dTinv[r * C + s] * t.M[r * C + s];
      dTinv[r * C + s] *= t.beta[s];
    }
  mm<T>(true, false, C, C, C, 1, t.M, C, dTinv, C, 0, X, C);
  mm<T>(false, true, C, C, C, -1, X, C, t.M, C, 0, dL, C);
  for (int64_t r = 0; r < C; ++r) {
    T acc = 0;
    for (int64_t s = 0; s < C; ++s) {
      const T l = s < r ? dL[r * C + s] : T(0);
      acc += l * t.Akk[r * C + s];
      dAkk[r * C + s] = l * t.beta[r];
    }
    db[r] += acc;
  }

  // the decayed products' gradients: rows R_t = Σ_{s ≤ t} D_ts k_s e^{G_t − G_s} for D = dAqk (-> q·scale) and
  // dAkk (-> k), columns Q_s = Σ_{t ≥ s} (dAkk_ts k_t + dAqk_ts q_t) e^{G_t − G_s} (-> k)
  std::fill(dqr, dqr + 3 * C * K, T(0));
  for (int64_t r0 = 0; r0 < C; r0 += BS) {
    if (r0 > 0) {
      T *a = w.a, *b = w.b, *y = w.y, *x = w.x, *tmp = w.tmp;
      block_factors(t.G, r0, K, fl, a, b);
      for (int64_t s = 0; s < r0 * K; ++s) y[s] = t.kc[s] * b[s];
      for (int64_t i = 0; i < 2; ++i) {  // rows: dAqk -> dq, dAkk -> dk
        const T* D = (i == 0 ? dAqk : dAkk) + r0 * C;
        T* out = (i == 0 ? dqr : dkr) + r0 * K;
        mm<T>(false, false, BS, K, r0, 1, D, C, y, K, 0, tmp, K);
        for (int64_t e = 0; e < BS * K; ++e) out[e] += a[e] * tmp[e];
      }
      for (int64_t i = 0; i < BS; ++i) {
        const T *ai = a + i * K, *kc = t.kc + (r0 + i) * K, *qs = t.qs + (r0 + i) * K;
        T *xk = x + i * K, *xq = x + (BS + i) * K;
#pragma omp simd
        for (int64_t c = 0; c < K; ++c) xk[c] = kc[c] * ai[c], xq[c] = qs[c] * ai[c];
      }
      mm<T>(true, false, r0, K, BS, 1, dAkk + r0 * C, C, x, K, 0, tmp, K);
      mm<T>(true, false, r0, K, BS, 1, dAqk + r0 * C, C, x + BS * K, K, 1, tmp, K);
      for (int64_t e = 0; e < r0 * K; ++e) dkc[e] += b[e] * tmp[e];
    }
    for (int64_t tt = r0; tt < r0 + BS; ++tt) {  // the pairs inside the block, as chunk_terms walks them
      const T *kt = t.kc + tt * K, *qt = t.qs + tt * K;
      T *dqt = dqr + tt * K, *dkt = dkr + tt * K, *f = w.f;
      std::fill_n(f, K, T(1));
      for (int64_t s = tt - 1; s >= r0; --s) {
        const T *e = t.eg + (s + 1) * K, *ks = t.kc + s * K;
        const T dqk = dAqk[tt * C + s], dkk = dAkk[tt * C + s];
        T* dks = dkc + s * K;
#pragma omp simd
        for (int64_t c = 0; c < K; ++c) {
          const T fc = std::max(f[c] * e[c], tiny);
          f[c] = fc;
          dqt[c] += dqk * ks[c] * fc;
          dkt[c] += dkk * ks[c] * fc;
          dks[c] += (dkk * kt[c] + dqk * qt[c]) * fc;
        }
      }
      const T dqk = dAqk[tt * C + tt];
      T* dks = dkc + tt * K;
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) dqt[c] += dqk * kt[c], dks[c] += dqk * qt[c];
    }
  }

  // dG, then dq, dk and dg = the reverse cumulative sum of dG (G = cumsum g)
  for (int64_t r = 0; r < C; ++r) {
    const int64_t o = r * K;
#pragma omp simd
    for (int64_t c = 0; c < K; ++c)
      dG[o + c] = t.qs[o + c] * dqr[o + c] + t.kc[o + c] * (dkr[o + c] - dkc[o + c]) + dkG[o + c] * t.kG[o + c] +
                  dqd[o + c] * t.qG[o + c] - dkd[o + c] * t.kd[o + c];
  }
  T* last = dG + (C - 1) * K;
  for (int64_t c = 0; c < K; ++c) last[c] += dgend[c] * t.gend[c];
  for (int64_t r = 0; r < C; ++r)
    for (int64_t c = 0; c < K; ++c) last[c] += dkd[r * K + c] * t.kd[r * K + c];
  for (int64_t r = 0; r < C; ++r) {
    const int64_t o = r * K;
    T *dqo = dq + r * in.sk, *dko = dk + r * in.sk;
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) {
      dqo[c] = (dqr[o + c] + dqd[o + c] * t.gam[o + c]) * scale;
      dko[c] = dkr[o + c] + dkc[o + c] + dkG[o + c] * t.gam[o + c] + dkd[o + c] * t.to_end[o + c];
    }
  }
  for (int64_t c = 0; c < K; ++c) dg[(C - 1) * in.sk + c] = last[c];
  for (int64_t r = C - 2; r >= 0; --r) {
    const T *above = dg + (r + 1) * in.sk, *dGr = dG + r * K;
    T* out = dg + r * in.sk;
#pragma omp simd
    for (int64_t c = 0; c < K; ++c) out[c] = above[c] + dGr[c];
  }
  for (int64_t r = 0; r < C; ++r) dbeta[r * sb] = db[r];
}

// What the backward keeps of one chunk between its steps: the terms, u (C, V), du (C, V; first Aqkᵀ do),
// (qΓ)ᵀ do (K, V) and the state's gradient after the chunk (K, V).
template <typename T>
struct ChunkGrad {
  Terms<T> t;
  T *u, *du, *qdo, *dSa;
  static int64_t size(int64_t C, int64_t K, int64_t V) { return Terms<T>::size(C, K, V) + 2 * C * V + 2 * K * V; }
  static ChunkGrad at(T* p, int64_t C, int64_t K, int64_t V) {
    ChunkGrad c;
    c.t = Terms<T>::at(p, C, K, V);
    c.u = p + Terms<T>::size(C, K, V), c.du = c.u + C * V, c.qdo = c.du + C * V, c.dSa = c.qdo + K * V;
    return c;
  }
};

template <typename T>
void backward(const Shape& d, const T* q, const T* k, const T* v, const T* g, const T* beta, T scale, const T* starts,
              const T* d_o, const T* dfinal, const Sequences& seqs, T* dq, T* dk, T* dv, T* dg, T* dbeta, T* dh0) {
  const int64_t C = d.C, K = d.K, V = d.V, BH = d.BH(), KV = K * V, csize = ChunkGrad<T>::size(C, K, V);
  auto do_at = [&](int64_t bh, int64_t n) { return d_o + ((bh / d.H * d.T + n * C) * d.H + bh % d.H) * V; };
  // the chunk-parallel part: its terms, u = U − W S, Aqkᵀ do and (qΓ)ᵀ do
  auto prepare = [&](int64_t bh, int64_t n, const ChunkGrad<T>& c, Scratch<T>& w) {
    chunk_terms(rows_of(d, q, k, v, g, beta, bh, n), scale, C, K, V, c.t, w);
    const T *Sn = starts + (bh * d.NC + n) * KV, *don = do_at(bh, n);
    std::copy_n(c.t.U, C * V, c.u);
    mm<T>(false, false, C, V, K, -1, c.t.W, K, Sn, V, 1, c.u, V);
    mm<T>(true, false, C, V, C, 1, c.t.Aqk, C, don, d.H * V, 0, c.du, V);
    mm<T>(true, false, K, V, C, 1, c.t.qG, K, don, d.H * V, 0, c.qdo, V);
  };
  // backwards through the recursion: du = Aqkᵀ do + kd dS', dS = Γ_C dS' + (qΓ)ᵀ do − Wᵀ du
  auto recurse = [&](int64_t bh, int64_t n, const ChunkGrad<T>& c, T* dS) {
    const int64_t seq_out = seqs.ends(bh, n), seq_in = seqs.starts(bh, n);
    if (seq_out >= 0) {
      if (dfinal)
        std::copy_n(dfinal + (seq_out * d.H + bh % d.H) * KV, KV, dS);
      else
        std::fill_n(dS, KV, T(0));
    }
    std::copy_n(dS, KV, c.dSa);
    mm<T>(false, false, C, V, K, 1, c.t.kd, K, dS, V, 1, c.du, V);
    for (int64_t r = 0; r < K; ++r) {
      const T gc = c.t.gend[r];
#pragma omp simd
      for (int64_t x = 0; x < V; ++x) dS[r * V + x] = dS[r * V + x] * gc + c.qdo[r * V + x];
    }
    mm<T>(true, false, K, V, C, -1, c.t.W, K, c.du, V, 1, dS, V);
    if (seq_in >= 0) std::copy_n(dS, KV, dh0 + (seq_in * d.H + bh % d.H) * KV);
  };
  // everything else: dAqk = tril(do uᵀ), d(qΓ) = do Sᵀ, dkd = u dS'ᵀ, dΓ_C = Σ_v dS' ⊙ S, dW = −du Sᵀ, then the terms'
  auto finish = [&](int64_t bh, int64_t n, const ChunkGrad<T>& c, Scratch<T>& w) {
    const int64_t own = C * C + 3 * C * K + K;  // dAqk (C, C); dqd, dkd, dW (C, K); dgend (K)
    T* grads = workspace<T>(1, own + 5 * C * C + 5 * C * K + C);
    T* scratch = grads + own;  // terms_backward's: 5 (C, C), 5 (C, K), (C)
    T *dAqk = grads, *dqd = dAqk + C * C, *dkd = dqd + C * K, *dW = dkd + C * K, *dgend = dW + C * K;
    const T *Sn = starts + (bh * d.NC + n) * KV, *don = do_at(bh, n);
    mm<T>(false, true, C, C, V, 1, don, d.H * V, c.u, V, 0, dAqk, C);
    for (int64_t r = 0; r < C; ++r) std::fill(dAqk + r * C + r + 1, dAqk + (r + 1) * C, T(0));
    mm<T>(false, true, C, K, V, 1, don, d.H * V, Sn, V, 0, dqd, K);
    mm<T>(false, true, C, K, V, 1, c.u, V, c.dSa, V, 0, dkd, K);
    mm<T>(false, true, C, K, V, -1, c.du, V, Sn, V, 0, dW, K);
    for (int64_t r = 0; r < K; ++r) {
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t x = 0; x < V; ++x) acc += c.dSa[r * V + x] * Sn[r * V + x];
      dgend[r] = acc;
    }
    const int64_t tok = (bh / d.H * d.T + n * C) * d.H + bh % d.H;
    terms_backward(rows_of(d, q, k, v, g, beta, bh, n), c.t, scale, C, K, V, c.du, dW, dAqk, dqd, dkd, dgend,
                   dq + tok * K, dk + tok * K, dv + tok * V, dg + tok * K, dbeta + tok, d.H, w, scratch);
  };
  if (by_head(d)) {
    at::parallel_for(0, BH, 1, [&](int64_t lo, int64_t hi) {
      Scratch<T> w(C, K);
      T* p = workspace<T>(0, csize + KV);
      const ChunkGrad<T> c = ChunkGrad<T>::at(p, C, K, V);
      T* dS = p + csize;
      for (int64_t bh = lo; bh < hi; ++bh) {
        std::fill_n(dS, KV, T(0));  // a last chunk that ends no sequence: no state gradient enters it
        for (int64_t n = d.NC - 1; n >= 0; --n) {
          prepare(bh, n, c, w);
          recurse(bh, n, c, dS);
          finish(bh, n, c, w);
        }
      }
    });
    return;
  }
  const int64_t NG = std::min(d.NC, group_chunks(d));
  T* buf = workspace<T>(0, NG * BH * csize);
  T* dstate = workspace<T>(2, BH * KV);
  std::fill_n(dstate, BH * KV, T(0));
  auto at_ = [&](int64_t bh, int64_t j) { return ChunkGrad<T>::at(buf + (bh * NG + j) * csize, C, K, V); };
  for (int64_t c0 = (d.NC - 1) / NG * NG; c0 >= 0; c0 -= NG) {
    const int64_t n_g = std::min(NG, d.NC - c0);
    at::parallel_for(0, BH * n_g, 1, [&](int64_t lo, int64_t hi) {
      Scratch<T> w(C, K);
      for (int64_t i = lo; i < hi; ++i) prepare(i / n_g, c0 + i % n_g, at_(i / n_g, i % n_g), w);
    });
    at::parallel_for(0, BH, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t bh = lo; bh < hi; ++bh)
        for (int64_t j = n_g - 1; j >= 0; --j) recurse(bh, c0 + j, at_(bh, j), dstate + bh * KV);
    });
    at::parallel_for(0, BH * n_g, 1, [&](int64_t lo, int64_t hi) {
      Scratch<T> w(C, K);
      for (int64_t i = lo; i < hi; ++i) finish(i / n_g, c0 + i % n_g, at_(i / n_g, i % n_g), w);
    });
  }
}

// ---- the operators -------------------------------------------------------------------------------------------

void check(const at::Tensor& x, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(x.device().is_cpu(), "k3_kda: ", name, " must be on the CPU, got ", x.device());
  TORCH_CHECK(x.scalar_type() == dtype, "k3_kda: ", name, " must be ", dtype, ", got ", x.scalar_type());
  TORCH_CHECK(x.dim() == dim, "k3_kda: ", name, " must have ", dim, " dimensions, got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "k3_kda: ", name, " must be contiguous");
}

void check_shape(const at::Tensor& x, const char* name, at::IntArrayRef want) {
  TORCH_CHECK(x.sizes() == want, "k3_kda: ", name, " must have shape ", want, ", got ", x.sizes());
}

Shape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, int64_t chunk_size) {
  Shape d{q.size(0), q.size(1), q.size(2), q.size(3), v.size(3), chunk_size, 0};
  for (const auto& [x, name] : {std::pair{&k, "k"}, {&g, "g"}}) check_shape(*x, name, q.sizes());
  check_shape(v, "v", {d.B, d.T, d.H, d.V});
  check_shape(beta, "beta", {d.B, d.T, d.H});
  TORCH_CHECK(chunk_size % BS == 0 && chunk_size > 0, "k3_kda: chunk_size must be a multiple of ", BS);
  TORCH_CHECK(d.T % chunk_size == 0, "k3_kda: T (", d.T, ") must be a multiple of chunk_size (", chunk_size, ")");
  d.NC = d.T / chunk_size;
  return d;
}

Sequences sequences_of(const std::optional<at::Tensor>& first, const std::optional<at::Tensor>& last, const Shape& d,
                       int64_t num_seqs) {
  if (!first.has_value()) {
    TORCH_CHECK(num_seqs == d.B, "k3_kda: num_seqs must be B (", d.B, ") without packed sequences, got ", num_seqs);
    return {nullptr, nullptr, d.NC, d.H};
  }
  TORCH_CHECK(d.B == 1 && last.has_value(), "k3_kda: packed sequences need B == 1 and both seq_first and seq_last");
  for (const auto* x : {&*first, &*last}) check(*x, "seq_first/seq_last", at::kLong, 1);
  TORCH_CHECK(first->numel() == d.NC && last->numel() == d.NC, "k3_kda: seq_first/seq_last need one entry a chunk");
  for (const auto* x : {&*first, &*last})
    TORCH_CHECK(x->numel() == 0 || (x->min().item<int64_t>() >= -1 && x->max().item<int64_t>() < num_seqs),
                "k3_kda: seq_first/seq_last entries must be -1 or a sequence index below num_seqs (", num_seqs, ")");
  return {first->data_ptr<int64_t>(), last->data_ptr<int64_t>(), d.NC, d.H};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& g, const at::Tensor& beta, double scale,
                                                         int64_t chunk_size, const std::optional<at::Tensor>& h0,
                                                         const std::optional<at::Tensor>& seq_first,
                                                         const std::optional<at::Tensor>& seq_last, int64_t num_seqs,
                                                         bool keep_starts) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "k3_kda: float32 or float64 inputs, got ", dtype);
  for (const auto& [x, name] : {std::pair{&q, "q"}, {&k, "k"}, {&g, "g"}, {&v, "v"}}) check(*x, name, dtype, 4);
  check(beta, "beta", dtype, 3);
  const Shape d = shape_of(q, k, v, g, beta, chunk_size);
  const Sequences seqs = sequences_of(seq_first, seq_last, d, num_seqs);
  auto o = at::empty_like(v);
  if (h0.has_value()) check(*h0, "h0", dtype, 4), check_shape(*h0, "h0", {num_seqs, d.H, d.K, d.V});
  auto final = h0.has_value() ? h0->clone() : at::zeros({num_seqs, d.H, d.K, d.V}, q.options());
  auto starts = at::empty({keep_starts ? d.BH() : 0, d.NC, d.K, d.V}, q.options());
  if (d.NC == 0) return {o, final, starts};
  AT_DISPATCH_FLOATING_TYPES(dtype, "k3_kda_chunk_fwd", [&] {
    forward<scalar_t>(d, q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
                      g.const_data_ptr<scalar_t>(), beta.const_data_ptr<scalar_t>(), static_cast<scalar_t>(scale),
                      h0.has_value() ? h0->const_data_ptr<scalar_t>() : nullptr, seqs, o.data_ptr<scalar_t>(),
                      final.data_ptr<scalar_t>(), keep_starts ? starts.data_ptr<scalar_t>() : nullptr);
  });
  return {o, final, starts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_bwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const at::Tensor& starts, const at::Tensor& d_o, const std::optional<at::Tensor>& dfinal, double scale,
    int64_t chunk_size, const std::optional<at::Tensor>& seq_first, const std::optional<at::Tensor>& seq_last,
    int64_t num_seqs) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "k3_kda: float32 or float64 inputs, got ", dtype);
  for (const auto& [x, name] : {std::pair{&q, "q"}, {&k, "k"}, {&g, "g"}, {&v, "v"}, {&d_o, "do"}, {&starts, "starts"}})
    check(*x, name, dtype, 4);
  check(beta, "beta", dtype, 3);
  const Shape d = shape_of(q, k, v, g, beta, chunk_size);
  const Sequences seqs = sequences_of(seq_first, seq_last, d, num_seqs);
  check_shape(starts, "starts", {d.BH(), d.NC, d.K, d.V});
  check_shape(d_o, "do", v.sizes());
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v), dg = at::empty_like(g);
  auto dbeta = at::empty_like(beta);
  // a sequence without chunks passes its final state's gradient straight through
  if (dfinal.has_value()) check(*dfinal, "dfinal", dtype, 4), check_shape(*dfinal, "dfinal", {num_seqs, d.H, d.K, d.V});
  auto dh0 = dfinal.has_value() ? dfinal->clone() : at::zeros({num_seqs, d.H, d.K, d.V}, q.options());
  if (d.NC == 0) return {dq, dk, dv, dg, dbeta, dh0};
  AT_DISPATCH_FLOATING_TYPES(dtype, "k3_kda_chunk_bwd", [&] {
    backward<scalar_t>(d, q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
                       g.const_data_ptr<scalar_t>(), beta.const_data_ptr<scalar_t>(), static_cast<scalar_t>(scale),
                       starts.const_data_ptr<scalar_t>(), d_o.const_data_ptr<scalar_t>(),
                       dfinal.has_value() ? dfinal->const_data_ptr<scalar_t>() : nullptr, seqs, dq.data_ptr<scalar_t>(),
                       dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), dg.data_ptr<scalar_t>(),
                       dbeta.data_ptr<scalar_t>(), dh0.data_ptr<scalar_t>());
  });
  return {dq, dk, dv, dg, dbeta, dh0};
}

}  // namespace

TORCH_LIBRARY(k3_kda, m) {
  m.def(
      "chunk_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, int chunk_size, Tensor? h0, "
      "Tensor? seq_first, Tensor? seq_last, int num_seqs, bool keep_starts) -> (Tensor, Tensor, Tensor)");
  m.def(
      "chunk_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor starts, Tensor do, Tensor? dfinal, "
      "float scale, int chunk_size, Tensor? seq_first, Tensor? seq_last, int num_seqs) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(k3_kda, CPU, m) {
  m.impl("chunk_fwd", &chunk_fwd);
  m.impl("chunk_bwd", &chunk_bwd);
}
