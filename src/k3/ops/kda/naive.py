"""The per-timestep KDA recurrence: the reference every fast path is tested against (SPEC §2.1).

Per head, with state S ∈ ℝ^{K×V}:

    S_t = (I − β_t k_t k_tᵀ) · Diag(exp g_t) · S_{t−1} + β_t k_t v_tᵀ
    o_t = S_tᵀ (scale · q_t)

It computes in the dtype of its inputs, so tests run it in float64.
"""

import torch


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k: (B, T, H, K); v: (B, T, HV, V); g: (B, T, HV, K); beta: (B, T, HV); state (B, HV, K, V).

    HV is a multiple of H (grouped value heads share a q/k head, as in fla). Returns (o (B, T, HV, V),
    final state or None).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    q = q.repeat_interleave(HV // H, dim=2) * scale
    k = k.repeat_interleave(HV // H, dim=2)
    S = q.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S = S + initial_state.to(S.dtype)
    o = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # decay each key channel
        kS = torch.einsum("bhk,bhkv->bhv", k[:, t], S)  # what the memory predicts for k_t
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], v[:, t] - kS)
        o.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(o, dim=1) if T else v.new_zeros(B, 0, HV, V)
    return o.to(v.dtype), (S if output_final_state else None)
