"""Chunkwise-parallel KDA in pure PyTorch: prefill and training (SPEC §2.1).

Inside a chunk of C tokens, with G_t = Σ_{s≤t} g_s the cumulative log-decay (per key channel) and
Γ_t = exp(G_t), unrolling the recurrence from the chunk's start state S₀ gives

    u      = (I + A)⁻¹ · β ⊙ (v − (k ⊙ Γ) S₀)            the delta-rule "new information" per token
    A_ts   = β_t Σ_c k_tc k_sc e^{G_tc − G_sc}            s < t   (strictly lower)
    o      = (q ⊙ Γ) S₀ + P u,   P_ts = Σ_c q_tc k_sc e^{G_tc − G_sc}   s ≤ t
    S_C    = Γ_C ⊙ S₀ + (k ⊙ e^{G_C − G})ᵀ u

Splitting u = U − W S₀ with U = (I + A)⁻¹ β v and W = (I + A)⁻¹ β k Γ (the WY/UT form) leaves only
two small matmuls per chunk in the sequential part; everything else runs for all chunks at once.

The per-channel factors e^{G_tc − G_sc} are computed as dense matmuls by splitting each chunk into
row blocks of 16 tokens and pivoting every row block at its first token r: e^{G_t − r} · e^{r − G_s}.
For s before the block both factors are ≤ 1, so they never overflow; inside the block the second
factor is at most e^{15·|g|max}, which the bounded gate (g ≥ −5) keeps below e^75, inside fp32.
Unbounded gates that exceed this are detected and the diagonal blocks recomputed exactly.

The chunk-parallel terms live in chunk_terms.py, which the hand-written backward (chunk_bwd.py) shares.
"""

import torch

import k3.ops.kda.cpu_kernel as cpu_kernel
from k3.ops.autograd import first_derivative_only
from k3.ops.kda.backend import kernels, on_device, resolve
from k3.ops.kda.chunk_bwd import chunk_kda_bwd
from k3.ops.kda.chunk_terms import chunk_groups, chunk_terms, group_inputs, sequence_chunks, unchunked
from k3.ops.kda.inputs import KDAFlags, check_inputs, prepare, seq_bounds


def chunk_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    chunk_size: int,
    seq_chunks: list[tuple[int, int]] | None = None,
    keep_starts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The chunked algorithm on prepared inputs (heads already expanded, flags applied), no autograd.

    q, k, g: (B, T, H, K); v: (B, T, H, V); beta: (B, T, H); all in the compute dtype (fp32 or
    fp64). T need not be a multiple of chunk_size: the last chunk is zero-padded, which leaves the
    state untouched (g = 0, β = 0). initial_state: (N, H, K, V) or None.
    seq_chunks: for packed sequences (B == 1, laid out chunk-aligned by the caller), each sequence's
    [first, last) chunk; the state restarts from that sequence's initial state at its first chunk.
    None means one sequence per batch row.
    Returns o (B, T, H, V), the final states (N, H, K, V) and the state at the start of every chunk
    (B·H, NC, K, V): what the backward and a prefix cache's checkpoints read (None unless keep_starts;
    collecting them is a copy of one K×V state per chunk that plain inference never reads).

    Only the state recursion is sequential (u = U − W S, S ← Γ_C S + kdᵀ u: two matmuls a chunk); the
    outputs o = (qΓ) S + Aqk u are then computed for a whole group of chunks at once.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NC = -(-T // C)
    seq_chunks, first, last, h0 = sequence_chunks(seq_chunks, NC, initial_state, B, H, K, V)
    zeros = q.new_zeros(B * H, K, V)
    S, finals = zeros, list(h0)
    o = q.new_empty(B, T, H, V)
    # the state entering every chunk: written in place by the recursion (the backward and prefix caches read it)
    starts = q.new_empty(B * H, NC, K, V) if keep_starts else None
    for c0, c1 in chunk_groups(B, H, C, K, V, NC):
        t = chunk_terms(*group_inputs((q, k, v, g, beta), c0, c1, C, T), scale, C)
        S_n = starts[:, c0:c1] if keep_starts else q.new_empty(B * H, c1 - c0, K, V)
        us = []
        for j in range(c1 - c0):
            n = c0 + j
            if n in first:
                S = zeros if h0[first[n]] is None else h0[first[n]].reshape(B * H, K, V).to(q.dtype)
            S_n[:, j] = S
            u = torch.baddbmm(t.U[:, j], t.W[:, j], S, alpha=-1)  # U − W S
            us.append(u)
            S = torch.baddbmm(t.decay_end[:, j] * S, t.kd[:, j].transpose(-1, -2), u)
            if n in last:
                finals[last[n]] = S
        o_n = torch.matmul(t.q_decay, S_n).add_(t.Aqk @ torch.stack(us, dim=1))  # (BH, n, C, V)
        o[:, c0 * C : min(T, c1 * C)] = unchunked(o_n, B)[:, : min(T, c1 * C) - c0 * C]

    final = torch.cat([(zeros if s is None else s.to(q.dtype)).reshape(-1, H, K, V) for s in finals])
    return o, final, starts


def _passes(q: torch.Tensor, chunk_size: int):
    """(forward, backward) for prepared inputs like q: the C++ kernel where it runs them, else the reference."""
    if cpu_kernel.usable(q, chunk_size):
        return cpu_kernel.chunk_fwd, cpu_kernel.chunk_bwd
    return chunk_kda_fwd, chunk_kda_bwd


class ChunkKDAFunction(torch.autograd.Function):
    """The chunked forward with a hand-written backward: the chunk start states are kept, the chunk-parallel terms
    recomputed, and the state recursion run backwards. On the CPU both passes run in the C++ kernel
    (cpu_kernel.py) where it is built, else in chunk_kda_fwd / chunk_kda_bwd. Inputs as chunk_kda_fwd's."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, chunk_size, seq_chunks):
        fwd, ctx.bwd = _passes(q, chunk_size)
        o, final, starts = fwd(q, k, v, g, beta, scale, initial_state, chunk_size, seq_chunks)
        ctx.save_for_backward(q, k, v, g, beta, starts)
        ctx.config = (scale, chunk_size, seq_chunks, initial_state is not None)
        return o, final

    @staticmethod
    @first_derivative_only
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, starts = ctx.saved_tensors
        scale, chunk_size, seq_chunks, has_h0 = ctx.config
        dq, dk, dv, dg, dbeta, dh0 = ctx.bwd(q, k, v, g, beta, starts, do, dfinal, scale, chunk_size, seq_chunks)
        return dq, dk, dv, dg, dbeta, (dh0 if has_h0 else None), None, None, None


def _chunk_fwd(q, k, v, g, beta, scale, h0, chunk_size, seq_chunks=None, chunk_states=False):
    """o, final states and (if chunk_states) the chunk start states; through the hand-written backward
    when a gradient is needed (chunk_states comes only in inference mode, without one)."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, h0)):
        return (*ChunkKDAFunction.apply(q, k, v, g, beta, h0, scale, chunk_size, seq_chunks), None)
    return _passes(q, chunk_size)[0](q, k, v, g, beta, scale, h0, chunk_size, seq_chunks, keep_starts=chunk_states)


CHUNK_SIZES = (32, 64)  # what fla's kernels accept; the torch path agrees, so a call never depends on the backend


def chunk_kda(
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
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Chunkwise-parallel KDA with fla.ops.kda.chunk_kda's arguments (fla 0.6.0's order) and semantics.

    q, k: (B, T, H, K); v: (B, T, HV, V); g: (B, T, HV, K) log-decay (raw gate input when
    use_gate_in_kernel); beta: (B, T, HV) (logits when use_beta_sigmoid_in_kernel);
    initial_state: (N, HV, K, V), or (N, HV, V, K) with state_v_first; cu_seqlens: (N+1,) packed
    sequence bounds with B == 1, on q's device; cu_seqlens_cpu: the same bounds on the CPU (the torch
    path reads them instead of synchronising with the device). chunk_size: 32 or 64, as fla.
    disable_recompute: fla keeps its intermediates for the backward instead of recomputing them; the
    torch path always keeps what autograd needs, so the flag changes no result.
    return_intermediate_states (inside torch.inference_mode(), as fla requires): also return h, the state
    at the start of every chunk, (B, NC, HV, K, V) ((1, total chunks, ...) for packed sequences, each
    sequence's chunks in order), in k's dtype as fla stores it: what a prefix cache checkpoints.
    Any T; gradients flow to q, k, v, g, beta, initial_state (and A_log, dt_bias).
    Returns o (B, T, HV, V) in v's dtype and, if output_final_state, the final states (N, HV, K, V)
    in fp32 (fp64 for fp64 inputs); then h if asked.
    """
    flags = KDAFlags(
        use_qk_l2norm_in_kernel,
        use_gate_in_kernel,
        use_beta_sigmoid_in_kernel,
        allow_neg_eigval,
        safe_gate,
        lower_bound,
    )
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES} (as fla's KDA kernels), got {chunk_size}")
    if return_intermediate_states:
        if not torch.is_inference_mode_enabled():
            raise ValueError("return_intermediate_states=True bypasses autograd: call it inside torch.inference_mode()")
        if disable_recompute:
            raise ValueError("return_intermediate_states=True cannot be combined with disable_recompute=True (as fla)")
    h0_user = initial_state
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, flags, A_log, dt_bias, cu_seqlens_cpu)
    if resolve(backend, q) == "fla":
        kwargs = dict(
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval,
            safe_gate=safe_gate,
            lower_bound=lower_bound,
            disable_recompute=disable_recompute,
            return_intermediate_states=return_intermediate_states,
            state_v_first=state_v_first,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_size=chunk_size,
            A_log=A_log,
            dt_bias=dt_bias,
        )
        # fla asserts an fp32 initial state; the torch path upcasts any state, so the seam does too.
        h0 = None if h0_user is None else h0_user.float()
        with on_device(q):
            return kernels().chunk_kda(
                q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=output_final_state, **kwargs
            )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q2, k2, v2, g2, b2, h0 = prepare(q, k, v, g, beta, initial_state, flags, A_log, dt_bias)
    states = return_intermediate_states
    if cu_seqlens is None:
        o, final, h = _chunk_fwd(q2, k2, v2, g2, b2, scale, h0, chunk_size, chunk_states=states)
    else:
        # Lay the sequences out chunk-aligned (each padded to whole chunks with neutral zeros) so a
        # chunk never straddles two of them; the state restarts at each sequence's first chunk.
        C, seq_chunks, dst, start = chunk_size, [], [], 0
        for s, e in seq_bounds(cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu):
            n = -(-(e - s) // C)
            seq_chunks.append((start, start + n))
            dst.append(torch.arange(start * C, start * C + e - s, device=q.device))
            start += n
        dst = torch.cat(dst)
        padded = [x.new_zeros(1, start * C, *x.shape[2:]).index_copy(1, dst, x) for x in (q2, k2, v2, g2, b2)]
        o, final, h = _chunk_fwd(*padded, scale, h0, C, seq_chunks, chunk_states=states)
        o = o.index_select(1, dst)
    if h is not None:  # (B·H, NC, K, V) -> (B, NC, H, K, V)
        h = h.view(q2.shape[0], q2.shape[2], -1, *h.shape[-2:]).transpose(1, 2)
    if state_v_first:
        final = final.transpose(-1, -2)
        h = None if h is None else h.transpose(-1, -2)
    out = (o.to(v.dtype), final if output_final_state else None)
    return (*out, h.to(k.dtype)) if return_intermediate_states else out
