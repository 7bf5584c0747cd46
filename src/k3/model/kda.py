"""The KDA layer (SPEC §2.1): projections, short causal convolutions, the bounded forget gate and
the delta-rule recurrence of k3.ops.kda, then a gated per-head RMSNorm and the output projection."""

import math

import torch
import torch.nn.functional as F
from torch import nn

import k3.ops.kda.cpu_kernel as cpu_kernel
from k3.config import K3Config
from k3.model.cache import GroupedLayerCache, KDALayerCache, sequence_mixing
from k3.model.derived import DerivedWeight
from k3.model.gated_norm import gated_rms_norm
from k3.model.norm import RMSNorm
from k3.model.short_conv import causal_conv
from k3.ops.kda import chunk_kda, fused_recurrent_kda


class KimiDeltaAttention(nn.Module):
    """x (B, T, d) -> (B, T, d). Parameter names follow the released checkpoint (`self_attn.*`)."""

    def __init__(self, config: K3Config):
        super().__init__()
        d, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        V, w = K, config.short_conv_kernel_size
        self.H, self.K, self.V = H, K, V
        self.lower_bound = config.gate_lower_bound
        self.q_proj = nn.Linear(d, H * K, bias=False)
        self.k_proj = nn.Linear(d, H * K, bias=False)
        self.v_proj = nn.Linear(d, H * V, bias=False)
        self.q_conv1d = nn.Conv1d(H * K, H * K, w, groups=H * K, bias=False)
        self.k_conv1d = nn.Conv1d(H * K, H * K, w, groups=H * K, bias=False)
        self.v_conv1d = nn.Conv1d(H * V, H * V, w, groups=H * V, bias=False)
        # low-rank forget gate: one log-decay per head and key channel
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(d, H * V, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, V, bias=False)
            self.g_b_proj = nn.Linear(V, H * V, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.o_norm = RMSNorm(V, config.rms_norm_eps)
        self.o_proj = nn.Linear(H * V, d, bias=False)
        # concatenations of parameters, kept across inference calls (k3.model.derived)
        self._fused_input = DerivedWeight(lambda *ws: torch.cat(ws))
        self._fused_conv = DerivedWeight(lambda *ws: torch.cat(ws))

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """dt_bias = softplus⁻¹(dt) with dt log-uniform in [1e-3, 0.1], and A_log per gate kind, as fla's KDA
        layer (`fla/layers/kda.py`) does: for the bounded gate A_log = 0 (rate 1), for the unbounded gate
        rates A ∈ [1, 16].

        Why the kinds differ: the unbounded gate −A·softplus(f + dt_bias) starts at −A·dt, so A ∈ [1, 16]
        gives decays of 1e-3…1.6 per token. The bounded gate lb·sigmoid(A·(f + dt_bias)) saturates instead:
        with dt_bias ≈ log dt ∈ [−6.9, −2.3], a rate of 16 sends sigmoid to e⁻³⁷…e⁻¹¹ and the channel starts
        (and, in the quickstart, stays) with no forgetting at all; rate 1 starts it at 5·dt, 0.005…0.45."""
        if self.lower_bound is None:
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        else:
            self.A_log.zero_()
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1)))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, cache: KDALayerCache | GroupedLayerCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, V = self.H, self.K, self.V
        # every projection of x in one matmul over the weights concatenated (q, k, v then go through one
        # convolution over their channels); at inference the concatenation is kept until a parameter
        # changes (k3.model.derived), under autograd it is rebuilt each call so gradients reach each weight
        out = F.linear(x, self._fused_input(*self._input_weights()))
        qkv, f_a, beta_raw, g_a = out.split(
            [2 * H * K + H * V, K, H, out.shape[-1] - 2 * H * K - H * V - K - H], dim=-1
        )
        gate_out = g_a if hasattr(self, "g_proj") else self.g_b_proj(g_a)
        g_raw = self.f_b_proj(f_a).view(B, T, H, K)
        o = sequence_mixing(cache, self.mix, qkv, g_raw, beta_raw)  # (B, T, H, V)
        gated = gated_rms_norm(o, self.o_norm.weight, gate_out.view(B, T, H, V), self.o_norm.eps)
        return self.o_proj(gated.reshape(B, T, H * V))

    def _input_weights(self) -> list[torch.Tensor]:
        """The weights of every projection that reads x: q, k, v, the forget gate's first factor, beta,
        and the output gate's first factor (or the full-rank output gate)."""
        g = self.g_proj.weight if hasattr(self, "g_proj") else self.g_a_proj.weight
        return [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.f_a_proj.weight, self.b_proj.weight, g]

    def mix(self, qkv: torch.Tensor, g_raw: torch.Tensor, beta_raw: torch.Tensor, cache: KDALayerCache | None):
        """The sequence mixing: convolutions, then the delta rule from the cached state.

        qkv (B, T, 2HK + HV) before the convolution; g_raw (B, T, H, K); beta_raw (B, T, H) -> o (B, T, H, V).
        """
        B, T, _ = qkv.shape
        H, K, V = self.H, self.K, self.V
        w_conv = self._fused_conv(self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        kw = dict(
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            lower_bound=self.lower_bound,
        )
        if T == 1 and cache is not None and not torch.is_grad_enabled():
            # decoding on the CPU: the convolutions and the recurrence in one C++ call, in place where the cache
            # keeps the states and conv tails (the path below is its reference)
            where = cache.decode_rows()
            if where is not None and cpu_kernel.conv_step_usable(qkv, where[0], where[1]):
                o = cpu_kernel.conv_recurrent_kda(qkv[:, 0], g_raw[:, 0], beta_raw[:, 0], w_conv, *where, **kw)
                return o.unsqueeze(1)
        qkv, tail = causal_conv(qkv, w_conv, cache.conv if cache is not None else None)
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, V)
        if cache is None:
            return chunk_kda(q, k, v, g_raw, beta_raw, **kw)[0]
        cache.conv = tail
        if T == 1 and not torch.is_grad_enabled():
            # decoding: the recurrent step updates the states where they live, the cache's own tensor or
            # rows of a serving pool (fla's ssm_state_indices), with no gathered copy to write back
            o = cache.update_state(
                lambda states, rows: fused_recurrent_kda(
                    q,
                    k,
                    v,
                    g_raw,
                    beta_raw,
                    initial_state=states,
                    ssm_state_indices=rows,
                    inplace_final_state=True,
                    **kw,
                )[0]
            )
            if o is not None:
                return o
        # a longer piece (prefill): the chunked form
        o, cache.state = chunk_kda(q, k, v, g_raw, beta_raw, initial_state=cache.state, output_final_state=True, **kw)
        return o
