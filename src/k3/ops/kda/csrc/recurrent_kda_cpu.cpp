// One decoding step of KDA on the CPU, in place on the caller's states: the operator k3_kda::recurrent_step.
// fused_recurrent.py's torch path is the reference; for one token per sequence it runs ~20 small ATen ops
// (the norms, the gate, the sigmoid, two read-outs and the update), each a pass over tiny tensors from
// Python, where this runs one pass per (sequence, head) with the head's state in L1.
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
#include <vector>

namespace {

template <typename T>
void step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
          const at::Tensor& beta, const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
          double scale, std::optional<double> lower_bound, bool l2norm, bool gate, bool beta_sigmoid,
          bool neg_eigval, at::Tensor& states, const std::optional<at::Tensor>& rows, at::Tensor& o) {
  const int64_t B = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* gp = g.data_ptr<T>();
  const T* bp = beta.data_ptr<T>();
  T* sp = states.data_ptr<T>();
  T* op = o.data_ptr<T>();
  const int64_t* rp = rows ? rows->data_ptr<int64_t>() : nullptr;
  std::vector<T> alog, dtb;  // the gate's parameters in the compute dtype
  if (gate && A_log) alog = std::vector<T>(A_log->data_ptr<T>(), A_log->data_ptr<T>() + H);
  if (gate && dt_bias) dtb = std::vector<T>(dt_bias->data_ptr<T>(), dt_bias->data_ptr<T>() + H * K);
  const T floor_ln = T(0.35) * std::log(std::numeric_limits<T>::min());
  const T eps = T(1e-6);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> dec(K), qd(K), kd(K), kb(K), rk(V), rq(V);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H;
      const T* qi = qp + b * q.stride(0) + h * q.stride(1);
      const T* ki = kp + b * k.stride(0) + h * k.stride(1);
      const T* vi = vp + b * v.stride(0) + h * v.stride(1);
      const T* gi = gp + b * g.stride(0) + h * g.stride(1);
      const T bi_raw = bp[b * beta.stride(0) + h * beta.stride(1)];
      T* S = sp + (rp ? rp[b] : b) * states.stride(0) + h * K * V;
      T* oi = op + (b * H + h) * V;
      T qn = 1, kn = 1;
      if (l2norm) {  // x / sqrt(Σx² + 1e-6), as the reference's l2norm
        T sq = 0, sk = 0;
        for (int64_t c = 0; c < K; ++c) sq += qi[c] * qi[c], sk += ki[c] * ki[c];
        qn = T(1) / std::sqrt(sq + eps), kn = T(1) / std::sqrt(sk + eps);
      }
      const T bi = beta_sigmoid ? (neg_eigval ? T(2) : T(1)) / (T(1) + std::exp(-bi_raw)) : bi_raw;
      const T rate = gate && !alog.empty() ? std::exp(alog[h]) : T(1);
      T qk = 0;
      for (int64_t c = 0; c < K; ++c) {
        T gc = gi[c];
        if (gate) {
          const T z = gc + (dtb.empty() ? T(0) : dtb[h * K + c]);
          // bounded (K3): lower_bound·sigmoid(rate·z); unbounded: −rate·softplus(z) (linear above 20, as torch)
          gc = lower_bound ? T(*lower_bound) / (T(1) + std::exp(-rate * z))
                           : -rate * (z > T(20) ? z : std::log1p(std::exp(z)));
        }
        dec[c] = std::exp(std::max(gc, floor_ln));  // floored: no subnormal factor (decay.py)
        const T qc = qi[c] * qn * T(scale), kc = ki[c] * kn;
        qd[c] = qc * dec[c], kd[c] = kc * dec[c], kb[c] = kc * bi;
        qk += qc * kb[c];
      }
      for (int64_t j = 0; j < V; ++j) rk[j] = 0, rq[j] = 0;
      for (int64_t c = 0; c < K; ++c) {  // both read-outs from the state before the step, in one pass
        const T* Sc = S + c * V;
        const T a = kd[c], e = qd[c];
        for (int64_t j = 0; j < V; ++j) rk[j] += a * Sc[j], rq[j] += e * Sc[j];
      }
      for (int64_t j = 0; j < V; ++j) {
        rk[j] = vi[j] - rk[j];  // the error e
        oi[j] = rq[j] + qk * rk[j];
      }
      for (int64_t c = 0; c < K; ++c) {
        T* Sc = S + c * V;
        const T d = dec[c], w = kb[c];
        for (int64_t j = 0; j < V; ++j) Sc[j] = Sc[j] * d + w * rk[j];
      }
    }
  });
}

void check_rows(const at::Tensor& x, int64_t B, int64_t H, int64_t D, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == B && x.size(1) == H && x.size(2) == D, "recurrent_step: ", name,
              " must be (B, H, ", D, ") = (", B, ", ", H, ", ", D, "), got ", x.sizes());
  TORCH_CHECK(x.stride(2) == 1, "recurrent_step: ", name, "'s channels must be contiguous");
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
  auto o = at::empty({B, H, V}, v.options());
  if (dt == at::kFloat)
    step<float>(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, l2norm, gate, beta_sigmoid, neg_eigval, states,
                rows, o);
  else
    step<double>(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, l2norm, gate, beta_sigmoid, neg_eigval,
                 states, rows, o);
  return o;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(k3_kda, m) {
  m.def(
      "recurrent_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "float scale, float? lower_bound, bool l2norm, bool gate, bool beta_sigmoid, bool neg_eigval, "
      "Tensor(a!) states, Tensor? rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(k3_kda, CPU, m) { m.impl("recurrent_step", &recurrent_step); }
