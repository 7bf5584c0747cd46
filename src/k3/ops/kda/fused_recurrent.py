"""The token-by-token KDA recurrence for decoding: one or a few new tokens per sequence given a
state, optionally updating a caller-owned state tensor (or rows of a state pool) in place."""

import torch

from k3.ops.kda.backend import fla_kda, resolve
from k3.ops.kda.inputs import KDAFlags, check_inputs, compute_dtype, prepare, seq_bounds


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA one token at a time, with fla.ops.kda.fused_recurrent_kda's arguments and semantics.

    q, k: (B, T, H, K); v: (B, T, HV, V); g: (B, T, HV, K); beta: (B, T, HV); cu_seqlens (N+1,) with B == 1.
    initial_state: (N, HV, K, V), or with ssm_state_indices (N,) a pool (P, HV, K, V) of which
    sequence i uses row ssm_state_indices[i].
    inplace_final_state: write each sequence's final state back into initial_state (its pool row),
    without autograd, as a serving engine does after every decode step.
    Returns o (B, T, HV, V) in v's dtype and, if output_final_state, the final states (N, HV, K, V).
    """
    flags = KDAFlags(
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, False, lower_bound
    )
    pool = initial_state
    if ssm_state_indices is not None:
        _check_pool(pool, ssm_state_indices, v, k)
        initial_state = pool[ssm_state_indices]
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, flags, A_log, dt_bias)
    if inplace_final_state and pool is None:
        raise ValueError("inplace_final_state=True needs an initial_state to write into")
    if resolve(backend, q) == "fla":
        return _fla(
            q,
            k,
            v,
            g,
            beta,
            scale,
            pool,
            output_final_state,
            flags,
            cu_seqlens,
            A_log,
            dt_bias,
            ssm_state_indices,
            inplace_final_state,
        )

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v2, g, beta, h0 = prepare(q, k, v, g, beta, initial_state, flags, A_log, dt_bias)
    if cu_seqlens is not None:
        # One batch row per sequence, zero-padded at the end: zeros leave the state as it is.
        bounds = seq_bounds(cu_seqlens)
        L = max(e - s for s, e in bounds)
        rows = [x.new_zeros(len(bounds), L, *x.shape[2:]) for x in (q, k, v2, g, beta)]
        for i, (s, e) in enumerate(bounds):
            for row, x in zip(rows, (q, k, v2, g, beta), strict=True):
                row[i, : e - s] = x[0, s:e]
        q, k, v2, g, beta = rows

    B, T, HV, K = q.shape
    S = h0 if h0 is not None else q.new_zeros(B, HV, K, v.shape[-1])
    q = q * scale
    # Update S in place when nobody else sees it: a fresh zero state, a gathered pool copy, or the
    # caller's tensor that inplace_final_state asks to overwrite. Never under autograd.
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v2, g, beta, S))
    owned = not grad and (h0 is None or inplace_final_state or ssm_state_indices is not None)
    o = []
    for t in range(T):
        d = g[:, t].exp()  # (B, HV, K)
        kb = k[:, t] * beta[:, t, :, None]  # (B, HV, K)
        # S_t = D S + (βk)ᵀ e with e = v − (k⊙d) S, the value minus the decayed memory's prediction;
        # so q S_t = (q⊙d) S + (q·βk) e: both read-outs come from the previous S in one matmul
        reads = torch.stack([k[:, t] * d, q[:, t] * d], dim=-2) @ S  # (B, HV, 2, V)
        error = v2[:, t] - reads[..., 0, :]  # (B, HV, V)
        o.append(reads[..., 1, :] + (q[:, t] * kb).sum(-1, keepdim=True) * error)
        if owned:
            S.mul_(d.unsqueeze(-1)).addcmul_(kb.unsqueeze(-1), error.unsqueeze(-2))
        else:
            S = torch.addcmul(S * d.unsqueeze(-1), kb.unsqueeze(-1), error.unsqueeze(-2))
            owned = not grad
    o = torch.stack(o, dim=1) if T else v2.new_zeros(B, 0, HV, v.shape[-1])  # (B, T, HV, V)
    if cu_seqlens is not None:
        o = torch.cat([o[i, : e - s] for i, (s, e) in enumerate(bounds)]).unsqueeze(0)

    if inplace_final_state:
        with torch.no_grad():
            if ssm_state_indices is None:
                if S is not pool:
                    pool.copy_(S)
            else:
                pool.index_copy_(0, ssm_state_indices, S.to(pool.dtype))
    return o.to(v.dtype), (S if output_final_state else None)


def _check_pool(pool: torch.Tensor | None, indices: torch.Tensor, v: torch.Tensor, k: torch.Tensor) -> None:
    if pool is None:
        raise ValueError("ssm_state_indices needs initial_state: the state pool (P, HV, K, V) it indexes")
    if pool.dim() != 4 or pool.shape[1:] != (v.shape[2], k.shape[3], v.shape[3]):
        raise ValueError(
            f"initial_state as a pool must be [P, HV, K, V] = [P, {v.shape[2]}, {k.shape[3]}, {v.shape[3]}], "
            f"got {list(pool.shape)}"
        )
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ssm_state_indices must be a 1-D int32/int64 tensor [N], got {indices.dtype}")
    if len(indices) and not (int(indices.min()) >= 0 and int(indices.max()) < len(pool)):
        raise ValueError(f"ssm_state_indices must lie in [0, {len(pool)}), got {indices.tolist()}")


def _fla(q, k, v, g, beta, scale, pool, output_final_state, flags, cu_seqlens, A_log, dt_bias, indices, inplace):
    """fla's kernel. Its public wrapper neither indexes a pool nor writes in place; its forward does."""
    fla = fla_kda()
    kwargs = dict(
        scale=scale,
        use_qk_l2norm_in_kernel=flags.use_qk_l2norm_in_kernel,
        use_gate_in_kernel=flags.use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=flags.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=flags.allow_neg_eigval,
        lower_bound=flags.lower_bound,
        cu_seqlens=cu_seqlens,
        A_log=A_log,
        dt_bias=dt_bias,
    )
    if indices is None and not inplace:
        return fla.fused_recurrent_kda(
            q, k, v, g, beta, initial_state=pool, output_final_state=output_final_state, **kwargs
        )
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    state = pool if inplace else pool.clone()
    o, _ = fused_recurrent_kda_fwd(
        q,
        k,
        v,
        g,
        beta,
        initial_state=state,
        output_final_state=True,
        inplace_final_state=True,
        ssm_state_indices=indices,
        **kwargs,
    )
    final = state if indices is None else state[indices]
    return o, (final.to(compute_dtype(q, v)) if output_final_state else None)
