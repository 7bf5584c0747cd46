"""The token-by-token KDA recurrence for decoding: one or a few new tokens per sequence given a
state, optionally updating a caller-owned state tensor (or rows of a state pool) in place."""

import torch

import k3.ops.kda.cpu_kernel as cpu_kernel
from k3.ops.kda.backend import KernelContractError, kernels, on_device, resolve
from k3.ops.kda.decay import floored_exp
from k3.ops.kda.inputs import KDAFlags, check_inputs, compute_dtype, prepare, seq_bounds


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    ssm_state_indices: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA one token at a time, with fla.ops.kda.fused_recurrent_kda's arguments (in its positional
    order) and semantics.

    q, k: (B, T, H, K); v: (B, T, HV, V); g: (B, T, HV, K); beta: (B, T, HV); cu_seqlens (N+1,) with B == 1.
    initial_state: (N, HV, K, V) ((N, HV, V, K) with state_v_first), or with ssm_state_indices a pool
    (P, HV, K, V) indexed by them:
      - ssm_state_indices (N,): sequence i reads its state from row i, and with inplace_final_state its
        final state is written back there.
      - ssm_state_indices (N, T) (fla's per-token form, for verifying several draft tokens): sequence i
        reads row [i, 0], and the state after its token t is written to row [i, t]; needs
        inplace_final_state. Entries past a sequence's length are not read.
    inplace_final_state: write the states into initial_state (or its pool rows) without autograd, as a
    serving engine does after every decode step. A state updated in place must be float32 (float64 for
    float64 inputs): the recurrence is never rounded to half precision between steps.
    Gradients flow (torch path) unless the state is updated in place; 'auto' never sends a call that
    needs gradients to fla, whose kernel has no backward.
    Returns o (B, T, HV, V) in v's dtype and, if output_final_state, the final states (N, HV, K, V).
    """
    flags = KDAFlags(
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, False, lower_bound
    )
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state=True needs an initial_state to write into")
    pool = initial_state
    if state_v_first and pool is not None:
        pool = pool.transpose(-1, -2)
    lengths = None
    if ssm_state_indices is not None:
        lengths = _check_pool(pool, ssm_state_indices, q, v, k, cu_seqlens, inplace_final_state)
        first = ssm_state_indices if ssm_state_indices.dim() == 1 else ssm_state_indices[:, 0]
        initial_state = pool[first]
    elif pool is not None:
        initial_state = pool
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, flags, A_log, dt_bias)
    dt = compute_dtype(q, k, v, g, beta)
    if inplace_final_state and pool.dtype != dt:
        raise ValueError(
            f"a state updated in place must be {dt} for {next(x.dtype for x in (q, k, v))} inputs, got {pool.dtype}: "
            "the recurrent state is kept in fp32 (fp64 for fp64 inputs) between steps"
        )
    grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias)
    )
    if resolve(backend, q, needs_grad=grad, op="fused_recurrent_kda") == "fla":
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
            lengths,
            inplace_final_state,
            state_v_first,
        )

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if (
        inplace_final_state
        and not grad
        and q.shape[1] == 1
        and cu_seqlens is None
        and (ssm_state_indices is None or ssm_state_indices.dim() == 1)
        and cpu_kernel.step_usable(q, v, pool)
    ):
        # a decoding step on the CPU: the C++ kernel, in place on the states (the torch path below is its
        # reference)
        o = cpu_kernel.recurrent_step(q, k, v, g, beta, A_log, dt_bias, scale, flags, pool, ssm_state_indices)
        final = None
        if output_final_state:
            final = pool if ssm_state_indices is None else pool[ssm_state_indices]
            final = final.transpose(-1, -2) if state_v_first else final
        return o.to(v.dtype), final
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
    per_token = ssm_state_indices is not None and ssm_state_indices.dim() == 2
    S = h0 if h0 is not None else q.new_zeros(B, HV, K, v.shape[-1])
    q = q * scale
    # Update S in place when nobody else sees it: a fresh zero state, a gathered pool copy, or the
    # caller's tensor that inplace_final_state asks to overwrite. Never under autograd.
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v2, g, beta, S))
    owned = not grad and (h0 is None or inplace_final_state or ssm_state_indices is not None)
    o = []
    for t in range(T):
        d = floored_exp(g[:, t])  # (B, HV, K); floored so a steep unbounded gate never makes S subnormal
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
        if per_token:
            live = (lengths > t).to(S.device)  # sequences that still have a token t
            with torch.no_grad():
                pool.index_copy_(0, ssm_state_indices[live, t], S[live])
    o = torch.stack(o, dim=1) if T else v2.new_zeros(B, 0, HV, v.shape[-1])  # (B, T, HV, V)
    if cu_seqlens is not None:
        o = torch.cat([o[i, : e - s] for i, (s, e) in enumerate(bounds)]).unsqueeze(0)

    if inplace_final_state and not per_token:
        with torch.no_grad():
            if ssm_state_indices is None:
                if S is not pool:
                    pool.copy_(S)
            else:
                pool.index_copy_(0, ssm_state_indices, S)
    if output_final_state and state_v_first:
        S = S.transpose(-1, -2)
    return o.to(v.dtype), (S if output_final_state else None)


def _check_pool(
    pool: torch.Tensor | None,
    indices: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    inplace: bool,
) -> torch.Tensor:
    """Validate a state pool and its indices; returns each sequence's token count (N,) on the CPU."""
    if pool is None:
        raise ValueError("ssm_state_indices needs initial_state: the state pool (P, HV, K, V) it indexes")
    if pool.dim() != 4 or pool.shape[1:] != (v.shape[2], k.shape[3], v.shape[3]):
        raise ValueError(
            f"initial_state as a pool must be [P, HV, K, V] = [P, {v.shape[2]}, {k.shape[3]}, {v.shape[3]}], "
            f"got {list(pool.shape)}"
        )
    if indices.dim() not in (1, 2) or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"ssm_state_indices must be an int32/int64 tensor [N] or [N, T], got {indices.dtype} {list(indices.shape)}"
        )
    if indices.device != q.device:
        raise ValueError(f"ssm_state_indices must be on q's device {q.device}, got {indices.device}")
    if cu_seqlens is not None:
        lengths = cu_seqlens.diff().cpu()
    else:
        lengths = torch.full((q.shape[0],), q.shape[1], dtype=torch.long)
    if len(indices) != len(lengths):
        raise ValueError(f"ssm_state_indices must have one row per sequence (N = {len(lengths)}), got {len(indices)}")
    used = indices
    if indices.dim() == 2:
        if not inplace:
            raise ValueError("per-token ssm_state_indices [N, T] write every token's state: pass inplace_final_state")
        T = int(lengths.max()) if len(lengths) else 0
        if indices.shape[1] < max(T, 1):
            raise ValueError(f"per-token ssm_state_indices need at least {max(T, 1)} columns, got {indices.shape[1]}")
        # only entries inside a sequence are read (fla's padding slots may hold anything, e.g. -1)
        mask = torch.arange(indices.shape[1]) < lengths.clamp_min(1)[:, None]
        used = indices.cpu()[mask]
    if len(used) and not (int(used.min()) >= 0 and int(used.max()) < len(pool)):
        raise ValueError(f"ssm_state_indices must lie in [0, {len(pool)}), got {indices.tolist()}")
    return lengths


def _fla(
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
    indices,
    lengths,
    inplace,
    state_v_first,
):
    """fla's kernel, given what its contract asks: contiguous [B, T, H, D] inputs, states read and
    written through row indices into an fp32 pool whose rows are contiguous, per-token indices when a
    sequence has more than one token, and the device of the inputs made current.

    pool is in [K, V] order; with state_v_first it is a transposed view of the caller's [V, K] rows,
    which fla reads and writes in that layout itself. Returns o and the final states (caller's layout)."""
    fla = kernels()
    if state_v_first and pool is not None:
        pool = pool.transpose(-1, -2)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    kwargs = dict(
        scale=scale,
        use_qk_l2norm_in_kernel=flags.use_qk_l2norm_in_kernel,
        use_gate_in_kernel=flags.use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=flags.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=flags.allow_neg_eigval,
        lower_bound=flags.lower_bound,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        A_log=A_log,
        dt_bias=dt_bias,
    )
    with on_device(q):
        if not inplace:
            # fla's public wrapper: no pool, no in-place write; a pool's rows are gathered first
            h0 = pool if indices is None else pool[indices if indices.dim() == 1 else indices[:, 0]]
            h0 = None if h0 is None else h0.float().contiguous()
            return fla.fused_recurrent_kda(
                q, k, v, g, beta, initial_state=h0, output_final_state=output_final_state, **kwargs
            )
        if indices is None:
            # a batch's own state tensor: addressed through row indices, which honour its row stride
            indices = torch.arange(len(pool), device=q.device, dtype=torch.int32)
            lengths = cu_seqlens.diff() if cu_seqlens is not None else torch.full((len(pool),), q.shape[1])
        if pool.dtype != torch.float32 or (pool[0].numel() and not pool[0].is_contiguous()):
            raise KernelContractError(f"fla writes states into fp32 rows with contiguous [HV, K, V]; got {pool.dtype}")
        T = int(lengths.max()) if len(lengths) else 0
        if indices.dim() == 1 and T > 1:
            # The kernel reads row indices[n·stride + t] for token t: one index per token. Every token of
            # sequence n writes its state to n's row; the last write is the final state.
            indices = indices[:, None].expand(len(indices), T)
        o, _ = fla.fused_recurrent.fused_recurrent_kda_fwd(
            q,
            k,
            v,
            g,
            beta,
            initial_state=pool,
            output_final_state=True,
            inplace_final_state=True,
            ssm_state_indices=indices.contiguous(),
            **kwargs,
        )
    if not output_final_state:
        return o, None
    last = indices if indices.dim() == 1 else indices.gather(1, (lengths.clamp_min(1) - 1).to(indices.device)[:, None])
    return o, pool[last.flatten()].to(compute_dtype(q, v))
