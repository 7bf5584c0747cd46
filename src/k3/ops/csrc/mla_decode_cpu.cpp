// MLA's absorbed attention for one new token per sequence, over latents that stay in the page pool: the operator
// k3_cpu::mla_paged_decode. GatedMLA.absorbed (with the pool's PagedMLALatents) is the reference: it gathers every
// cached latent of the sequence into a buffer, then runs ~15 ATen ops. Here the new latent is written into its
// slot, and each sequence's cached latents are read where they lie, in chunks of tokens across threads (each
// chunk's softmax over its own maximum, the chunks merged by their maxima and sums, as flash-decoding splits a
// long context).
//
//   q_lat,h = W_UK,h q_nope,h            (the query moved into latent space, (rank,))
//   s_t,h = scale·(q_lat,h · c_t + q_pe,h · k_pe,t)      p = softmax_t(s)      o_h = W_UV,h Σ_t p_t,h c_t
//
// q_nope (B, H, nope), q_pe (B, H, rope), c_kv (B, rank), k_pe (B, rope); w_kv (H·(nope + v), rank) the
// kv_b_proj weight (W_UK,h and W_UV,h are rows h·(nope + v) … of it); latents (pages, P, n_mla, rank + rope) the
// pool's view (any page and token strides, contiguous channels); tables (B, W) page ids, past (B,) tokens
// cached before the new one. Returns o (B, H, v).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

namespace {

constexpr int64_t CHUNK = 256;  // tokens per work item: one thread's share of a long context

// S the stored values' type (inputs, weight, pool, output), T the arithmetic's: S, or float for bfloat16.
template <typename S, typename T = S>
void decode(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& c_kv, const at::Tensor& k_pe,
            const at::Tensor& w_kv, at::Tensor& latents, int64_t layer, const at::Tensor& tables,
            const at::Tensor& past, double scale, at::Tensor& o) {
  const int64_t B = q_nope.size(0), H = q_nope.size(1), N = q_nope.size(2), R = c_kv.size(1), E = k_pe.size(1);
  const int64_t V = w_kv.size(0) / H - N, P = latents.size(1), D = R + E;
  const int64_t s0 = latents.stride(0), s1 = latents.stride(1), s2 = latents.stride(2);
  S* lat = latents.data_ptr<S>();
  const S* W = w_kv.data_ptr<S>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* pst = past.data_ptr<int64_t>();
  const int64_t TW = tables.size(1);
  auto slot = [&](int64_t b, int64_t t) { return lat + tab[b * TW + t / P] * s0 + (t % P) * s1 + layer * s2; };
  // the new latents into their slots, and every query in latent space (scaled), (B, H, D)
  std::vector<T> q(B * H * D);
  const S* cp = c_kv.data_ptr<S>();
  const S* kp = k_pe.data_ptr<S>();
  for (int64_t b = 0; b < B; ++b) {
    S* dst = slot(b, pst[b]);
    for (int64_t j = 0; j < R; ++j) dst[j] = cp[b * c_kv.stride(0) + j * c_kv.stride(1)];
    for (int64_t j = 0; j < E; ++j) dst[R + j] = kp[b * k_pe.stride(0) + j * k_pe.stride(1)];
  }
  const S* qn = q_nope.data_ptr<S>();
  const S* qp = q_pe.data_ptr<S>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      T* qi = q.data() + (b * H + h) * D;
      std::fill_n(qi, D, T(0));
      const S* wk = W + h * (N + V) * R;
      const S* qh = qn + b * q_nope.stride(0) + h * q_nope.stride(1);
      for (int64_t n = 0; n < N; ++n) {
        const T qv = static_cast<T>(qh[n]);
        for (int64_t j = 0; j < R; ++j) qi[j] += qv * static_cast<T>(wk[n * R + j]);
      }
      for (int64_t j = 0; j < R; ++j) qi[j] *= T(scale);
      const S* ph = qp + b * q_pe.stride(0) + h * q_pe.stride(1);
      for (int64_t j = 0; j < E; ++j) qi[R + j] = static_cast<T>(ph[j]) * T(scale);
    }
  // work items: (sequence, chunk of its L = past + 1 keys); partial max, sum and Σ p·c per item and head
  std::vector<int64_t> item_b, item_t0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t0 = 0; t0 <= pst[b]; t0 += CHUNK) item_b.push_back(b), item_t0.push_back(t0);
  const int64_t I = static_cast<int64_t>(item_b.size());
  std::vector<T> m(I * H), l(I * H), acc(I * H * R);
  at::parallel_for(0, I, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> s(H * CHUNK);  // the chunk's scores, head-major
    std::vector<const S*> rows(CHUNK);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = item_b[i], t0 = item_t0[i], n = std::min(t0 + CHUNK, pst[b] + 1) - t0;
      T* mi = m.data() + i * H;
      T* li = l.data() + i * H;
      T* ai = acc.data() + i * H * R;
      for (int64_t t = 0; t < n; ++t) rows[t] = slot(b, t0 + t);
      // scores, then each head's maximum, weights and sums over the chunk: no per-token rescaling
      for (int64_t t = 0; t < n; ++t) {
        const S* c = rows[t];
        for (int64_t h = 0; h < H; ++h) {
          const T* qi = q.data() + (b * H + h) * D;
          T dot = 0;
#pragma omp simd reduction(+ : dot)  // vectorised: a reduction GCC leaves scalar without it (no -ffast-math)
          for (int64_t j = 0; j < D; ++j) dot += qi[j] * static_cast<T>(c[j]);
          s[h * CHUNK + t] = dot;
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        T* sh = s.data() + h * CHUNK;
        T mx = -std::numeric_limits<T>::infinity(), sum = 0;
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sh[t]);
        for (int64_t t = 0; t < n; ++t) sh[t] = std::exp(sh[t] - mx), sum += sh[t];
        mi[h] = mx, li[h] = sum;
      }
      std::fill_n(ai, H * R, T(0));
      for (int64_t t = 0; t < n; ++t) {
        const S* c = rows[t];
        for (int64_t h = 0; h < H; ++h) {
          const T p = s[h * CHUNK + t];
          T* ah = ai + h * R;
#pragma omp simd
          for (int64_t j = 0; j < R; ++j) ah[j] += p * static_cast<T>(c[j]);
        }
      }
    }
  });
  // merge each sequence's items, then o_h = W_UV,h ctx_h
  S* op = o.data_ptr<S>();
  std::vector<T> ctx(R);
  int64_t i0 = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t i1 = i0;
    while (i1 < I && item_b[i1] == b) ++i1;
    for (int64_t h = 0; h < H; ++h) {
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t i = i0; i < i1; ++i) mx = std::max(mx, m[i * H + h]);
      T sum = 0;
      std::fill(ctx.begin(), ctx.end(), T(0));
      for (int64_t i = i0; i < i1; ++i) {
        const T r = std::exp(m[i * H + h] - mx);
        sum += l[i * H + h] * r;
        const T* ah = acc.data() + (i * H + h) * R;
        for (int64_t j = 0; j < R; ++j) ctx[j] += ah[j] * r;
      }
      const S* wv = W + (h * (N + V) + N) * R;
      S* oh = op + (b * H + h) * V;
      for (int64_t u = 0; u < V; ++u) {
        T dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < R; ++j) dot += static_cast<T>(wv[u * R + j]) * ctx[j];
        oh[u] = static_cast<S>(dot / sum);
      }
    }
    i0 = i1;
  }
}

at::Tensor mla_paged_decode(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& c_kv,
                            const at::Tensor& k_pe, const at::Tensor& w_kv, at::Tensor latents, int64_t layer,
                            const at::Tensor& tables, const at::Tensor& past, double scale) {
  const auto dt = q_nope.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16,
              "mla_paged_decode: float32, float64 or bfloat16 inputs, got ", dt);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q_pe, &c_kv, &k_pe, &w_kv, &latents})
    TORCH_CHECK(t->scalar_type() == dt && t->device().is_cpu(), "mla_paged_decode: every input must be ", dt,
                " on the CPU");
  TORCH_CHECK(q_nope.dim() == 3 && q_pe.dim() == 3 && q_nope.size(0) == q_pe.size(0) && q_nope.size(1) == q_pe.size(1),
              "mla_paged_decode: q_nope and q_pe must be (B, H, ·)");
  TORCH_CHECK(q_nope.stride(2) == 1 && q_pe.stride(2) == 1, "mla_paged_decode: queries need contiguous channels");
  const int64_t B = q_nope.size(0), H = q_nope.size(1), R = c_kv.size(1), E = k_pe.size(1);
  TORCH_CHECK(q_pe.size(2) == E, "mla_paged_decode: q_pe and k_pe must have the same width");
  TORCH_CHECK(c_kv.dim() == 2 && k_pe.dim() == 2 && c_kv.size(0) == B && k_pe.size(0) == B,
              "mla_paged_decode: c_kv and k_pe must be (B, ·)");
  TORCH_CHECK(w_kv.dim() == 2 && w_kv.size(1) == R && w_kv.size(0) % H == 0 && w_kv.size(0) / H > q_nope.size(2) &&
                  w_kv.is_contiguous(),
              "mla_paged_decode: w_kv must be a contiguous (H·(nope + v), rank) weight");
  TORCH_CHECK(latents.dim() == 4 && latents.size(3) == R + E && latents.stride(3) == 1 && layer >= 0 &&
                  layer < latents.size(2),
              "mla_paged_decode: latents must be (pages, P, n_mla, rank + rope) with contiguous channels");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kLong && tables.is_contiguous(),
              "mla_paged_decode: tables must be a contiguous int64 (B, W) tensor");
  TORCH_CHECK(past.dim() == 1 && past.size(0) == B && past.scalar_type() == at::kLong && past.is_contiguous(),
              "mla_paged_decode: past must be a contiguous int64 (B,) tensor");
  const int64_t P = latents.size(1), TW = tables.size(1);
  const int64_t* pst = past.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = pst[b];
    TORCH_CHECK(n >= 0 && n / P < TW, "mla_paged_decode: sequence ", b, "'s ", n + 1, " tokens need more than ",
                TW, " pages");
    for (int64_t w = 0; w <= n / P; ++w) {
      const int64_t page = tab[b * TW + w];
      TORCH_CHECK(page >= 0 && page < latents.size(0), "mla_paged_decode: page ", page, " is outside the pool");
    }
  }
  auto o = at::empty({B, H, w_kv.size(0) / H - q_nope.size(2)}, q_nope.options());
  if (dt == at::kFloat)
    decode<float>(q_nope, q_pe, c_kv, k_pe, w_kv, latents, layer, tables, past, scale, o);
  else if (dt == at::kBFloat16)  // bf16 values, fp32 arithmetic (scores, softmax, sums), as SDPA's CPU kernel
    decode<at::BFloat16, float>(q_nope, q_pe, c_kv, k_pe, w_kv, latents, layer, tables, past, scale, o);
  else
    decode<double>(q_nope, q_pe, c_kv, k_pe, w_kv, latents, layer, tables, past, scale, o);
  return o;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3_cpu, m) {
  m.def(
      "mla_paged_decode(Tensor q_nope, Tensor q_pe, Tensor c_kv, Tensor k_pe, Tensor w_kv, Tensor(a!) latents, "
      "int layer, Tensor tables, Tensor past, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3_cpu, CPU, m) { m.impl("mla_paged_decode", &mla_paged_decode); }
