// One decoding step of KDA on the CPU, in place on the caller's states: the operators k3_kda::recurrent_step
// (the recurrence, fused_recurrent_kda's) and k3_kda::conv_recurrent_step (the layer's short convolutions, their
// tails shifted in place, then the recurrence: a KDA layer's whole sequence mixing for one token).
// fused_recurrent.py's torch path (and short_conv.causal_conv_reference) is the reference; for one token per
// sequence it runs ~30 small ATen ops (the convolution, the norms, the gate, the sigmoid, two read-outs and the
// update), each a pass over tiny tensors from Python, where this runs one pass per sequence and head with the
// head's state in L1.
//
// Per sequence b and head h, with q, k l2-normalised (optionally), q scaled, d = e^g (g the gate,
// optionally computed here from g_raw, A_log and dt_bias, and floored as decay.py floors it) and β the
// write strength (optionally a sigmoid of the raw logit, times 2 with negative eigenvalues allowed):
//
//   e = v − (k⊙d) S,    o = (q⊙d) S + (q·βk) e,    S ← diag(d) S + (βk)ᵀ e
//
// the same association as the reference (both read-outs from the state before the step).
//
// Layouts: q, k, g (B, H, K) and v (B, H, V), beta (B, H), any batch and head strides with contiguous
// channels; states either a pool (P, H, K, V) read and written at rows (B,), or B states whose rows may be
// strided (a view of a pool's rows in arithmetic progression), each (H, K, V) contiguous.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// The gate and write-strength options of one call, and the per-head parameters in the compute dtype.
template <typename T>
struct Options {
  int64_t H, K, V;
  T scale;
  std::optional<double> lower_bound;
  bool l2norm, gate, beta_sigmoid, neg_eigval;
  std::vector<T> alog, dtb;  // A_log (H) and dt_bias (H·K), empty when not given or the gate is not computed
  T floor_ln = T(0.35) * std::log(std::numeric_limits<T>::min());
};

template <typename T>
Options<T> options(int64_t H, int64_t K, int64_t V, double scale, std::optional<double> lower_bound, bool l2norm,
                   bool gate, bool beta_sigmoid, bool neg_eigval, const std::optional<at::Tensor>& A_log,
                   const std::optional<at::Tensor>& dt_bias) {
  Options<T> o{H, K, V, T(scale), lower_bound, l2norm, gate, beta_sigmoid, neg_eigval, {}, {}};
  if (gate && A_log) o.alog.assign(A_log->data_ptr<T>(), A_log->data_ptr<T>() + H);
  if (gate && dt_bias) o.dtb.assign(dt_bias->data_ptr<T>(), dt_bias->data_ptr<T>() + H * K);
  return o;
}

// Scratch of one thread: K-long and V-long rows.
template <typename T>
struct Scratch {
  std::vector<T> dec, qd, kd, kb, rk, rq;
  Scratch(int64_t K, int64_t V) : dec(K), qd(K), kd(K), kb(K), rk(V), rq(V) {}
};

// One head of one sequence: qi, ki, gi (K), vi (V), the raw write strength; S (K, V) updated in place; oi (V).
template <typename T>
inline void head_step(const T* qi, const T* ki, const T* vi, const T* gi, T bi_raw, int64_t h, T* S, T* oi,
                      const Options<T>& p, Scratch<T>& w) {
  const int64_t K = p.K, V = p.V;
  const T eps = T(1e-6);
  T qn = 1, kn = 1;
  if (p.l2norm) {  // x / sqrt(Σx² + 1e-6), as the reference's l2norm
    T sq = 0, sk = 0;
#pragma omp simd reduction(+ : sq, sk)  // vectorised: GCC leaves a reduction scalar without it (no -ffast-math)
    for (int64_t c = 0; c < K; ++c) sq += qi[c] * qi[c], sk += ki[c] * ki[c];
    qn = T(1) / std::sqrt(sq + eps), kn = T(1) / std::sqrt(sk + eps);
  }
  const T bi = p.beta_sigmoid ? (p.neg_eigval ? T(2) : T(1)) / (T(1) + std::exp(-bi_raw)) : bi_raw;
  const T rate = p.gate && !p.alog.empty() ? std::exp(p.alog[h]) : T(1);
  T qk = 0;
  for (int64_t c = 0; c < K; ++c) {
    T gc = gi[c];
    if (p.gate) {
      const T z = gc + (p.dtb.empty() ? T(0) : p.dtb[h * K + c]);
      // bounded (K3): lower_bound·sigmoid(rate·z); unbounded: −rate·softplus(z) (linear above 20, as torch)
      gc = p.lower_bound ? T(*p.lower_bound) / (T(1) + std::exp(-rate * z))
                         : -rate * (z > T(20) ? z : std::log1p(std::exp(z)));
    }
    w.dec[c] = std::exp(std::max(gc, p.floor_ln));  // floored: no subnormal factor (decay.py)
    const T qc = qi[c] * qn * p.scale, kc = ki[c] * kn;
    w.qd[c] = qc * w.dec[c], w.kd[c] = kc * w.dec[c], w.kb[c] = kc * bi;
    qk += qc * w.kb[c];
  }
  for (int64_t j = 0; j < V; ++j) w.rk[j] = 0, w.rq[j] = 0;
  for (int64_t c = 0; c < K; ++c) {  // both read-outs from the state before the step, in one pass
    const T* Sc = S + c * V;
    const T a = w.kd[c], e = w.qd[c];
    for (int64_t j = 0; j < V; ++j) w.rk[j] += a * Sc[j], w.rq[j] += e * Sc[j];
  }
  for (int64_t j = 0; j < V; ++j) {
    w.rk[j] = vi[j] - w.rk[j];  // the error e
    oi[j] = w.rq[j] + qk * w.rk[j];
  }
  for (int64_t c = 0; c < K; ++c) {
    T* Sc = S + c * V;
    const T d = w.dec[c], kb = w.kb[c];
    for (int64_t j = 0; j < V; ++j) Sc[j] = Sc[j] * d + kb * w.rk[j];
  }
}

template <typename T>
void step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
          const at::Tensor& beta, const Options<T>& p, at::Tensor& states, const std::optional<at::Tensor>& rows,
          at::Tensor& o) {
  const int64_t B = q.size(0), H = p.H;
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *gp = g.data_ptr<T>();
  const T* bp = beta.data_ptr<T>();
  T* sp = states.data_ptr<T>();
  T* op = o.data_ptr<T>();
  const int64_t* rp = rows ? rows->data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> w(p.K, p.V);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H;
      head_step<T>(qp + b * q.stride(0) + h * q.stride(1), kp + b * k.stride(0) + h * k.stride(1),
                   vp + b * v.stride(0) + h * v.stride(1), gp + b * g.stride(0) + h * g.stride(1),
                   bp[b * beta.stride(0) + h * beta.stride(1)], h,
                   sp + (rp ? rp[b] : b) * states.stride(0) + h * p.K * p.V, op + (b * H + h) * p.V, p, w);
    }
  });
}

// The short convolutions' decoding step and then the recurrence, per sequence: x (C = 2HK + HV) the raw q, k,
// v channels, tail (C, w−1) the channels' last w−1 inputs (shifted by one in place), weight (C, w);
// y = silu(Σ_j tail_j·weight_j + x·weight_{w−1}) as short_conv.causal_conv_reference, then q, k, v = y's parts.
// S is the type of x, g, beta, the tails and the output; T the states' and the arithmetic's (S, or float for
// bfloat16: the tails hold bf16 values as the pool does, every sum and the state are fp32); Wt the weight's (S,
// or float in a bf16 model, which keeps the convolutions' taps in fp32 as the release stores them).
template <typename T, typename S = T, typename Wt = S>
void conv_step(const at::Tensor& x, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& weight,
               const Options<T>& p, at::Tensor& states, at::Tensor& convs, const std::optional<at::Tensor>& rows,
               at::Tensor& o) {
  const int64_t B = x.size(0), C = x.size(1), W = weight.size(-1), H = p.H, K = p.K;
  const S *xp = x.data_ptr<S>(), *gp = g.data_ptr<S>(), *bp = beta.data_ptr<S>();
  const Wt* wp = weight.data_ptr<Wt>();
  T* sp = states.data_ptr<T>();
  S* cp = convs.data_ptr<S>();
  S* op = o.data_ptr<S>();
  const int64_t* rp = rows ? rows->data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> w(p.K, p.V);
    std::vector<T> y(C), gt(std::is_same_v<S, T> ? 0 : K), ot(std::is_same_v<S, T> ? 0 : p.V);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t row = rp ? rp[b] : b;
      const S* xb = xp + b * x.stride(0);
      S* tail = cp + row * convs.stride(0);
      for (int64_t c = 0; c < C; ++c) {
        S* tc = tail + c * (W - 1);
        const Wt* wc = wp + c * W;
        T acc = 0;
        for (int64_t j = 0; j < W - 1; ++j) acc += static_cast<T>(tc[j]) * static_cast<T>(wc[j]);
        acc += static_cast<T>(xb[c]) * static_cast<T>(wc[W - 1]);
        y[c] = acc / (T(1) + std::exp(-acc));  // silu
        for (int64_t j = 0; j + 1 < W - 1; ++j) tc[j] = tc[j + 1];
        if (W > 1) tc[W - 2] = xb[c];
      }
      for (int64_t h = 0; h < H; ++h) {
        const S* gh = gp + b * g.stride(0) + h * g.stride(1);
        const T bh = static_cast<T>(bp[b * beta.stride(0) + h * beta.stride(1)]);
        T* state = sp + row * states.stride(0) + h * K * p.V;
        S* oh = op + (b * H + h) * p.V;
        if constexpr (std::is_same_v<S, T>) {
          head_step<T>(y.data() + h * K, y.data() + H * K + h * K, y.data() + 2 * H * K + h * p.V, gh, bh, h, state,
                       oh, p, w);
        } else {
          for (int64_t c = 0; c < K; ++c) gt[c] = static_cast<T>(gh[c]);
          head_step<T>(y.data() + h * K, y.data() + H * K + h * K, y.data() + 2 * H * K + h * p.V, gt.data(), bh, h,
                       state, ot.data(), p, w);
          for (int64_t j = 0; j < p.V; ++j) oh[j] = static_cast<S>(ot[j]);
        }
      }
    }
  });
}

void check_rows(const at::Tensor& x, int64_t B, int64_t H, int64_t D, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == B && x.size(1) == H && x.size(2) == D, "recurrent_step: ", name,
              " must be (B, H, ", D, ") = (", B, ", ", H, ", ", D, "), got ", x.sizes());
  TORCH_CHECK(x.stride(2) == 1, "recurrent_step: ", name, "'s channels must be contiguous");
}

void check_states(const at::Tensor& states, const std::optional<at::Tensor>& rows, int64_t B, int64_t H, int64_t K,
                  int64_t V, bool gate, std::optional<double> lower_bound, const std::optional<at::Tensor>& A_log,
                  const std::optional<at::Tensor>& dt_bias, at::ScalarType dt) {
  TORCH_CHECK(states.dim() == 4 && states.size(1) == H && states.size(2) == K && states.size(3) == V,
              "recurrent_step: states must be (·, H, K, V) = (·, ", H, ", ", K, ", ", V, "), got ", states.sizes());
  TORCH_CHECK(states.stride(3) == 1 && states.stride(2) == V && states.stride(1) == K * V,
              "recurrent_step: each state must be a contiguous (H, K, V) block");
  if (rows) {
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == B && rows->scalar_type() == at::kLong && rows->is_contiguous(),
                "recurrent_step: rows must be a contiguous int64 (B,) tensor");
    const int64_t* r = rows->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(r[b] >= 0 && r[b] < states.size(0), "recurrent_step: state row ", r[b], " is outside the pool's ",
                  states.size(0), " rows");
  } else {
    TORCH_CHECK(states.size(0) == B, "recurrent_step: without rows, states must hold B = ", B, " states");
  }
  if (gate) {
    TORCH_CHECK(lower_bound || A_log, "recurrent_step: the unbounded gate needs A_log");
    TORCH_CHECK(!A_log || (A_log->numel() == H && A_log->scalar_type() == dt && A_log->is_contiguous()),
                "recurrent_step: A_log must be H contiguous values of the inputs' dtype");
    TORCH_CHECK(!dt_bias || (dt_bias->numel() == H * K && dt_bias->scalar_type() == dt && dt_bias->is_contiguous()),
                "recurrent_step: dt_bias must be H·K contiguous values of the inputs' dtype");
  }
}

// q, k, g (B, H, K), v (B, H, V), beta (B, H); states (P, H, K, V) with rows (B,), or (B, H, K, V) without.
// Returns o (B, H, V); the states are updated in place.
at::Tensor recurrent_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                          const std::optional<at::Tensor>& dt_bias, double scale, std::optional<double> lower_bound,
                          bool l2norm, bool gate, bool beta_sigmoid, bool neg_eigval, at::Tensor states,
                          const std::optional<at::Tensor>& rows) {
  const int64_t B = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2);
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "recurrent_step: float32 or float64 inputs, got ", dt);
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&k, &v, &g, &beta, &states})
    TORCH_CHECK(x->scalar_type() == dt && x->device().is_cpu(), "recurrent_step: every input must be ", dt,
                " on the CPU");
  check_rows(q, B, H, K, "q");
  check_rows(k, B, H, K, "k");
  check_rows(v, B, H, V, "v");
  check_rows(g, B, H, K, "g");
  TORCH_CHECK(beta.dim() == 2 && beta.size(0) == B && beta.size(1) == H, "recurrent_step: beta must be (B, H)");
  check_states(states, rows, B, H, K, V, gate, lower_bound, A_log, dt_bias, dt);
  auto o = at::empty({B, H, V}, v.options());
  if (dt == at::kFloat) {
    const auto p = options<float>(H, K, V, scale, lower_bound, l2norm, gate, beta_sigmoid, neg_eigval, A_log, dt_bias);
    step<float>(q, k, v, g, beta, p, states, rows, o);
  } else {
    const auto p = options<double>(H, K, V, scale, lower_bound, l2norm, gate, beta_sigmoid, neg_eigval, A_log, dt_bias);
    step<double>(q, k, v, g, beta, p, states, rows, o);
  }
  return o;
}

// x (B, 2HK + HV) the raw q, k, v channels before the short convolutions, g (B, H, K), beta (B, H); conv_weight
// (2HK + HV, w); states as recurrent_step's; convs (P, 2HK + HV, w−1) with rows, or (B, ·, w−1) without, each
// row contiguous, shifted in place. Returns o (B, H, V). With bfloat16 inputs (a bf16 pool), the states, A_log
// and dt_bias are float32 (the pool's state dtype) and the arithmetic is too; conv_weight may be either.
at::Tensor conv_recurrent_step(const at::Tensor& x, const at::Tensor& g, const at::Tensor& beta,
                               const at::Tensor& conv_weight, const std::optional<at::Tensor>& A_log,
                               const std::optional<at::Tensor>& dt_bias, double scale,
                               std::optional<double> lower_bound, bool l2norm, bool gate, bool beta_sigmoid,
                               bool neg_eigval, at::Tensor states, at::Tensor convs,
                               const std::optional<at::Tensor>& rows) {
  const int64_t B = x.size(0), C = x.size(1), H = g.size(1), K = g.size(2);
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16,
              "conv_recurrent_step: float32, float64 or bfloat16 inputs, got ", dt);
  const auto compute = dt == at::kBFloat16 ? at::kFloat : dt;  // the states', A_log's and dt_bias's dtype
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "conv_recurrent_step: x must be (B, C) with contiguous channels");
  TORCH_CHECK((C - 2 * H * K) > 0 && (C - 2 * H * K) % H == 0, "conv_recurrent_step: x's ", C,
              " channels are not 2HK + HV for H = ", H, ", K = ", K);
  const int64_t V = (C - 2 * H * K) / H;
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&g, &beta, &convs})
    TORCH_CHECK(t->scalar_type() == dt && t->device().is_cpu(), "conv_recurrent_step: every input must be ", dt,
                " on the CPU");
  const bool fp32_taps = dt == at::kBFloat16 && conv_weight.scalar_type() == at::kFloat;
  TORCH_CHECK((conv_weight.scalar_type() == dt || fp32_taps) && conv_weight.device().is_cpu(),
              "conv_recurrent_step: conv_weight must be ", dt, dt == at::kBFloat16 ? " or float32" : "",
              " on the CPU");
  TORCH_CHECK(states.scalar_type() == compute && states.device().is_cpu(), "conv_recurrent_step: the states must be ",
              compute, " on the CPU");
  check_rows(g, B, H, K, "g");
  TORCH_CHECK(beta.dim() == 2 && beta.size(0) == B && beta.size(1) == H, "conv_recurrent_step: beta must be (B, H)");
  const int64_t W = conv_weight.size(-1);  // (C, w), or (C, 1, w) as nn.Conv1d keeps it
  TORCH_CHECK(conv_weight.size(0) == C && conv_weight.numel() == C * W && conv_weight.is_contiguous(),
              "conv_recurrent_step: conv_weight must be a contiguous (C, w) or (C, 1, w) tensor");
  TORCH_CHECK(convs.dim() == 3 && convs.size(1) == C && convs.size(2) == W - 1 && convs.stride(2) == 1 &&
                  convs.stride(1) == W - 1 && convs.size(0) == states.size(0),
              "conv_recurrent_step: convs must be (P, C, w−1) rows beside the states, each contiguous");
  check_states(states, rows, B, H, K, V, gate, lower_bound, A_log, dt_bias, compute);
  auto o = at::empty({B, H, V}, x.options());
  if (dt == at::kFloat) {
    const auto p = options<float>(H, K, V, scale, lower_bound, l2norm, gate, beta_sigmoid, neg_eigval, A_log, dt_bias);
    conv_step<float>(x, g, beta, conv_weight, p, states, convs, rows, o);
  } else if (dt == at::kBFloat16) {
    const auto p = options<float>(H, K, V, scale, lower_bound, l2norm, gate, beta_sigmoid, neg_eigval, A_log, dt_bias);
    if (fp32_taps)
      conv_step<float, at::BFloat16, float>(x, g, beta, conv_weight, p, states, convs, rows, o);
    else
      conv_step<float, at::BFloat16>(x, g, beta, conv_weight, p, states, convs, rows, o);
  } else {
    const auto p = options<double>(H, K, V, scale, lower_bound, l2norm, gate, beta_sigmoid, neg_eigval, A_log, dt_bias);
    conv_step<double>(x, g, beta, conv_weight, p, states, convs, rows, o);
  }
  return o;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3_kda, m) {
  m.def(
      "recurrent_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "float scale, float? lower_bound, bool l2norm, bool gate, bool beta_sigmoid, bool neg_eigval, "
      "Tensor(a!) states, Tensor? rows) -> Tensor");
  m.def(
      "conv_recurrent_step(Tensor x, Tensor g, Tensor beta, Tensor conv_weight, Tensor? A_log, Tensor? dt_bias, "
      "float scale, float? lower_bound, bool l2norm, bool gate, bool beta_sigmoid, bool neg_eigval, "
      "Tensor(a!) states, Tensor(b!) convs, Tensor? rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3_kda, CPU, m) {
  m.impl("recurrent_step", &recurrent_step);
  m.impl("conv_recurrent_step", &conv_recurrent_step);
}
