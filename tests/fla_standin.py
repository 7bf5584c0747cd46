"""A stand-in for fla 0.6.0's KDA kernels (fla.ops.kda), for tests on a CPU.

It enforces the input contract of fla's code as k3 calls it, and computes with k3's reference:
- `chunk_kda` (fla/ops/kda/chunk.py): its public wrapper makes inputs contiguous (input_guard) and
  has a backward; it raises for a chunk_size other than 32 or 64, asserts an fp32 initial_state,
  asserts inference mode for return_intermediate_states; Triton has no fp64.
- `fused_recurrent_kda` (fused_recurrent.py): public wrapper, contiguous-making, no backward (its
  outputs carry no gradient).
- `fused_recurrent.fused_recurrent_kda_fwd`: the internal forward k3 uses for in-place decoding. No
  input guard: it addresses q, k, v, g, beta as contiguous [B, T, H, D] memory, a state without
  indices as contiguous [N, HV, K, V] memory, a pool's rows through `stride(0)`, and reads the
  state-row index of sequence n, token t at `indices + n·indices.stride(0) + t` (one index per
  token); every token's state is stored in the pool's dtype.
Unknown keyword arguments raise (fla swallows them through **kwargs, which is how a flag it does not
know would be silently ignored). Every tensor must be on the kernel device.
"""

import itertools
import sys
import types

import torch

from k3.ops.kda import chunk_kda as k3_chunk_kda
from k3.ops.kda.backend import KernelContractError
from k3.ops.kda.inputs import KDAFlags, prepare

CALLS: list[str] = []  # which entry points ran, for tests that check the dispatch reached them

_FLAGS = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise KernelContractError(f"fla contract: {what}")


def _same_device(q: torch.Tensor, **tensors) -> None:
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor):
            _require(x.device == q.device, f"{name} is on {x.device}, q on {q.device}")


def _no_fp64(*xs) -> None:
    for x in xs:
        _require(x is None or x.dtype != torch.float64, "Triton kernels have no float64")


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    safe_gate=False,
    lower_bound=None,
    disable_recompute=False,
    return_intermediate_states=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    cp_context=None,
    use_graph=False,
    max_num_seqs=None,
    **kwargs,
):
    CALLS.append("chunk_kda")
    chunk_size, A_log, dt_bias = kwargs.pop("chunk_size", 64), kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    _require(not kwargs, f"chunk_kda got keywords fla 0.6.0 does not know: {sorted(kwargs)}")
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    _require(initial_state is None or initial_state.dtype == torch.float32, "initial_state must be in float32.")
    _same_device(q, k=k, v=v, g=g, beta=beta, h0=initial_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias)
    _no_fp64(q, k, v, g, beta)
    if return_intermediate_states:
        _require(torch.is_inference_mode_enabled(), "return_intermediate_states is only allowed in inference mode")
    out = k3_chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate,
        lower_bound=lower_bound,
        return_intermediate_states=return_intermediate_states,
        state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
        A_log=A_log,
        dt_bias=dt_bias,
        backend="torch",
    )
    o = out[0].to(q.dtype)  # fla returns o.type_as(q)
    return (o, *out[1:])


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    lower_bound=None,
    state_v_first=False,
    cu_seqlens=None,
    **kwargs,
):
    CALLS.append("fused_recurrent_kda")
    _require(not kwargs, f"fused_recurrent_kda got keywords fla 0.6.0 does not know: {sorted(kwargs)}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))  # its input_guard
    h0 = None if initial_state is None else initial_state.contiguous()
    with torch.no_grad():  # no backward in fla
        final = None
        if output_final_state:
            N = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
            shape = (
                (N, v.shape[2], v.shape[3], k.shape[3]) if state_v_first else (N, v.shape[2], k.shape[3], v.shape[3])
            )
            final = q.new_empty(shape, dtype=torch.float32)
        o = _recurrent_fwd(
            q,
            k,
            v,
            g,
            beta,
            A_log,
            dt_bias,
            scale,
            h0,
            final,
            None,
            cu_seqlens,
            state_v_first,
            use_qk_l2norm_in_kernel,
            use_gate_in_kernel,
            use_beta_sigmoid_in_kernel,
            allow_neg_eigval,
            lower_bound,
        )
    return o, final


def fused_recurrent_kda_fwd(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    initial_state=None,
    scale=None,
    output_final_state=False,
    inplace_final_state=True,
    state_v_first=False,
    cu_seqlens=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    lower_bound=None,
    out=None,
    **kwargs,
):
    CALLS.append("fused_recurrent_kda_fwd")
    _require(not kwargs, f"fused_recurrent_kda_fwd got keywords fla 0.6.0 does not know: {sorted(kwargs)}")
    _require(num_accepted_tokens is None, "k3 does not use speculative decoding's num_accepted_tokens")
    for name, x in dict(q=q, k=k, v=v, g=g, beta=beta).items():
        _require(x.is_contiguous(), f"{name} {list(x.shape)} must be contiguous [B, T, H, D] (no input guard)")
    _same_device(
        q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        state=initial_state,
        cu_seqlens=cu_seqlens,
        indices=ssm_state_indices,
        A_log=A_log,
        dt_bias=dt_bias,
    )
    _no_fp64(q, k, v, g, beta, initial_state)
    if inplace_final_state:
        _require(initial_state is not None, "inplace_final_state needs initial_state")
        final = initial_state
    else:
        final = None
    with torch.no_grad():
        o = _recurrent_fwd(
            q,
            k,
            v,
            g,
            beta,
            A_log,
            dt_bias,
            scale,
            initial_state,
            final,
            ssm_state_indices,
            cu_seqlens,
            state_v_first,
            use_qk_l2norm_in_kernel,
            use_gate_in_kernel,
            use_beta_sigmoid_in_kernel,
            allow_neg_eigval,
            lower_bound,
        )
    return o, final


def _rows(state: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """The state memory as the kernel addresses it: rows of HV·K·V values, `stride(0)` apart for a pool
    (continuous batching), densely packed otherwise."""
    inner = state.shape[1] * state.shape[2] * state.shape[3]
    if contiguous:
        return torch.as_strided(state, (state.shape[0], inner), (inner, 1))
    _require(state[0].is_contiguous(), "each pool row must be a contiguous [HV, K, V] block")
    return torch.as_strided(state, (state.shape[0], inner), (state.stride(0), 1))


def _recurrent_fwd(
    q, k, v, g, beta, A_log, dt_bias, scale, h0, ht, indices, cu_seqlens, v_first, l2, gate, sig, neg, lower_bound
):
    """The kernel's per-token loop in fp32. h0/ht: state tensors; with indices, pool rows; with ht given
    and indices, every token's state is stored at its row (continuous batching)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    flags = KDAFlags(l2, gate, sig, neg, False, lower_bound)
    out_dtype = v.dtype  # out = torch.zeros_like(v)
    q, k, v, g, beta, _ = prepare(q, k, v, g, beta, None, flags, A_log, dt_bias)  # fp32, heads expanded
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is None:
        bounds = [(n * T, n * T + T) for n in range(B)]
    else:
        bounds = list(itertools.pairwise(cu_seqlens.tolist()))
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    q, k, v, g, beta = map(flat, (q, k, v, g, beta))
    o = torch.zeros(B * T, HV, V, dtype=torch.float32)
    batching = indices is not None
    h0_rows = None if h0 is None else _rows(h0, contiguous=not batching)
    ht_rows = None if ht is None else _rows(ht, contiguous=not batching)
    if batching:
        # the kernel's address of token t's index in sequence n: indices + n·stride(0) + t
        stride = indices.stride(0)
        index_at = lambda n, t: int(torch.as_strided(indices, (1,), (1,), indices.storage_offset() + n * stride + t))  # noqa: E731
    for n, (bos, eos) in enumerate(bounds):
        if eos == bos and batching:
            continue
        S = torch.zeros(HV, K, V, dtype=torch.float32)
        if h0 is not None:
            row = h0_rows[index_at(n, 0)] if batching else h0_rows[n]
            S = row.view(HV, V, K).transpose(-1, -2).float() if v_first else row.view(HV, K, V).float()
        for t in range(eos - bos):
            i = bos + t
            S = S * g[i].exp()[:, :, None]
            err = (v[i] - (k[i][:, :, None] * S).sum(1)) * beta[i][:, None]
            S = S + k[i][:, :, None] * err[:, None, :]
            o[i] = (S * (q[i] * scale)[:, :, None]).sum(1)
            if batching and ht is not None:
                _store(ht_rows[index_at(n, t)], S, v_first)
        if ht is not None and not batching:
            _store(ht_rows[n], S, v_first)
    return o.view(B, T, HV, V).to(out_dtype)


def _store(row: torch.Tensor, S: torch.Tensor, v_first: bool) -> None:
    """b_h.to(p_ht.dtype.element_ty): the state rounded to the destination's dtype."""
    value = S.transpose(-1, -2) if v_first else S
    row.copy_(value.reshape(-1).to(row.dtype))


fused_recurrent = types.ModuleType("fused_recurrent")
fused_recurrent.fused_recurrent_kda_fwd = fused_recurrent_kda_fwd
module = sys.modules[__name__]
