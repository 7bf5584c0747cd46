"""KDA's C++ CPU kernels, called through torch.library operators with fake kernels so that torch.compile sees
each as one node: the chunked op's forward and backward (csrc/chunk_kda_cpu.cpp, `k3_kda::chunk_fwd` and
`k3_kda::chunk_bwd`) and the decoding step (csrc/recurrent_kda_cpu.cpp, `k3_kda::recurrent_step`).

The kernels compute what chunk.py / chunk_bwd.py and fused_recurrent.py's torch path compute (they stay the
reference, and the fallback where no C++ compiler is found), with each chunk's element-wise passes fused
while its rows are in cache and its small matmuls sent straight to BLAS. They are part of k3's one CPU
library (k3.ops.cpu_library: built on first use into `$K3_CACHE_DIR/kernels`, cached, loaded in well under a
second after that).

K3_KDA_CPU_KERNEL=off selects the reference; the default, auto, uses the kernel where it builds and says why
not where it does not (`k3 env`).
"""

import functools
import os

import torch

from k3.ops import cpu_library
from k3.ops.kda.chunk_terms import sequence_chunks
from k3.ops.kda.inputs import KDAFlags, pad_time

ENV_VAR = "K3_KDA_CPU_KERNEL"
CHOICES = ("auto", "off")
ROW_BLOCK = 16  # the kernel's row block (BS): chunk sizes must be multiples of it


def _register_fakes() -> None:
    @torch.library.register_fake("k3_kda::chunk_fwd")
    def _(q, k, v, g, beta, scale, chunk_size, h0, seq_first, seq_last, num_seqs, keep_starts):
        B, T, H, K = q.shape
        V = v.shape[-1]
        starts = q.new_empty(B * H if keep_starts else 0, T // chunk_size, K, V)
        return v.new_empty(v.shape), q.new_empty(num_seqs, H, K, V), starts

    @torch.library.register_fake("k3_kda::recurrent_step")
    def _(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, l2norm, gate, beta_sigmoid, neg_eigval, states, rows):
        return v.new_empty(v.shape)

    @torch.library.register_fake("k3_kda::conv_recurrent_step")
    def _(x, g, beta, conv_weight, A_log, dt_bias, scale, lower_bound, l2norm, gate, beta_sigmoid, neg_eigval, *rest):
        H, K = g.shape[1:]
        return x.new_empty(x.shape[0], H, (x.shape[1] - 2 * H * K) // H)

    @torch.library.register_fake("k3_kda::chunk_bwd")
    def _(q, k, v, g, beta, starts, do, dfinal, scale, chunk_size, seq_first, seq_last, num_seqs):
        H, K = q.shape[2:]
        new = [x.new_empty(x.shape) for x in (q, k, v, g, beta)]
        return (*new, q.new_empty(num_seqs, H, K, v.shape[-1]))


def choice() -> str:
    value = os.environ.get(ENV_VAR, "auto")
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {CHOICES}, got {value!r}")
    return value


@functools.cache
def _load() -> bool:
    """The library loaded (k3.ops.cpu_library) and the KDA operators' fake kernels registered, once."""
    if not cpu_library.load():
        return False
    _register_fakes()
    return True


# torch.compile reads these once while tracing (the build, the file reads and the environment stay out of the graph)
@torch.compiler.assume_constant_result
def _enabled() -> bool:
    return choice() == "auto" and _load()


@torch.compiler.assume_constant_result
def _loaded() -> bool:
    return _load()


def usable(x: torch.Tensor, chunk_size: int) -> bool:
    """Whether the kernel runs a chunked call on tensors like x (prepared: fp32 or fp64 on the CPU)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or chunk_size % ROW_BLOCK:
        return False
    return _enabled()


def describe() -> str:
    """One line for `k3 env`: which implementation the torch path's chunked KDA uses on the CPU, and why."""
    try:
        if choice() == "off":
            return f"PyTorch reference ({ENV_VAR}=off)"
    except ValueError as error:
        return f"error: {error}"
    if not _load():
        return f"PyTorch reference: {cpu_library.status()['reason']}"
    status = cpu_library.status()
    how = "built" if status["built"] else "loaded"
    return f"C++ kernel ({how} in {status['seconds']:.1f} s; cache {cpu_library.cache_dir()})"


def _require() -> None:
    if not _loaded():
        raise RuntimeError(f"k3's KDA CPU kernel is not available: {cpu_library.status()['reason']}")


def step_usable(q: torch.Tensor, v: torch.Tensor, states: torch.Tensor) -> bool:
    """Whether the kernel runs a decoding step (one token per sequence, states updated in place) on these: CPU,
    one dtype (fp32 or fp64) throughout, as many value heads as key heads, each state a contiguous block."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) or v.shape[2] != q.shape[2]:
        return False
    if states.dtype != q.dtype or states.dim() != 4 or not states[0].is_contiguous():
        return False
    return _enabled()


def recurrent_step(q, k, v, g, beta, A_log, dt_bias, scale, flags, states, rows) -> torch.Tensor:
    """fused_recurrent_kda's decoding step on the kernel: q, k, g (B, 1, H, K), v (B, 1, H, V), beta (B, 1, H),
    the raw inputs its flags describe; states (P, H, K, V) updated in place at rows (B,), or (B, H, K, V) with
    rows None. Returns o (B, 1, H, V)."""
    _require()
    dt = q.dtype

    o = torch.ops.k3_kda.recurrent_step(
        *(x.select(1, 0).to(dt) for x in (q, k, v, g, beta)),
        *_step_options(dt, A_log, dt_bias, scale, flags),
        states,
        None if rows is None else rows.to(torch.int64).contiguous(),
    )
    return o.unsqueeze(1)


def _step_options(dt: torch.dtype, A_log, dt_bias, scale: float, flags: KDAFlags) -> tuple:
    """The decoding operators' shared arguments after the inputs: the gate's parameters (flat, contiguous, in the
    compute dtype; passed as they are when already so) and the flags."""

    def ready(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not flags.use_gate_in_kernel:
            return None
        return t if (t.dtype == dt and t.is_contiguous()) else t.detach().to(dt).contiguous()

    return (
        ready(A_log),
        ready(dt_bias),
        float(scale),
        flags.lower_bound,
        flags.use_qk_l2norm_in_kernel,
        flags.use_gate_in_kernel,
        flags.use_beta_sigmoid_in_kernel,
        flags.allow_neg_eigval,
    )


def conv_recurrent_step(x, g, beta, conv_weight, A_log, dt_bias, scale, flags, states, convs, rows) -> torch.Tensor:
    """A KDA layer's sequence mixing for one token per sequence on the kernel: x (B, 2HK + HV) the q, k, v
    channels before the short convolutions (weights conv_weight (2HK + HV, 1, w)), g (B, H, K) and beta (B, H) raw
    as flags describe; states (P, H, K, V) and conv tails convs (P, 2HK + HV, w − 1) updated in place at rows (B,)
    (or B of each with rows None). Returns o (B, H, V). Called every layer of every decode step: tensors already
    in the compute dtype and contiguous are passed as they are."""
    _require()
    dt = x.dtype

    # fp32 taps of a bf16 model go in as they are (the kernel sums in fp32); any other dtype is cast to x's
    taps = (dt, torch.float32) if dt == torch.bfloat16 else (dt,)
    w = conv_weight if conv_weight.dtype in taps else conv_weight.to(dt)
    w = w if w.is_contiguous() else w.contiguous()
    return torch.ops.k3_kda.conv_recurrent_step(
        x,
        g if g.dtype == dt else g.to(dt),  # any batch and head strides
        beta if beta.dtype == dt else beta.to(dt),
        w.detach(),
        *_step_options(states.dtype, A_log, dt_bias, scale, flags),  # the gate's parameters in the state's dtype
        states,
        convs,
        rows,
    )


def conv_recurrent_kda(
    x: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    states: torch.Tensor,
    convs: torch.Tensor,
    rows: torch.Tensor | None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """conv_recurrent_step with fused_recurrent_kda's keywords: x (B, 2HK + HV), g (B, H, K), beta (B, H) ->
    o (B, H, V), the states and conv tails updated in place."""
    flags = KDAFlags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, False, False, lower_bound)
    scale = g.shape[-1] ** -0.5 if scale is None else scale
    if rows is not None and not rows.is_contiguous():
        rows = rows.contiguous()
    return conv_recurrent_step(x, g, beta, conv_weight, A_log, dt_bias, scale, flags, states, convs, rows)


def conv_step_usable(x: torch.Tensor, states: torch.Tensor, convs: torch.Tensor) -> bool:
    """Whether conv_recurrent_step runs on these: CPU, one dtype (fp32 or fp64) for the inputs, states and conv
    tails, or bf16 inputs and tails with fp32 states (a bf16 pool's), each state and tail a contiguous block (read
    from the strides: no view is made per call)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return False
    state_dtype = torch.float32 if x.dtype == torch.bfloat16 else x.dtype
    if states.dtype != state_dtype or convs.dtype != x.dtype or states.dim() != 4 or convs.dim() != 3:
        return False
    K, V = states.shape[2:]
    if states.stride()[1:] != (K * V, V, 1) or convs.stride()[1:] != (convs.shape[2], 1):
        return False
    return _enabled()


def _padded(x: torch.Tensor, T: int) -> torch.Tensor:
    """x (B, T0, ...) zero-padded in time to T (inputs.pad_time: neutral tokens), contiguous."""
    return (pad_time(x, T) if x.shape[1] != T else x).contiguous()


def _sequences(seq_chunks, NC: int, B: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """The operators' view of chunk_terms.sequence_chunks: per chunk, the packed sequence that starts / ends there
    (−1 elsewhere; None, None for one sequence per batch row), and the number of sequences."""
    if seq_chunks is None:
        return None, None, B
    _, starting, ending, _ = sequence_chunks(seq_chunks, NC, None, B, 0, 0, 0)
    first, last = (torch.full((NC,), -1, dtype=torch.int64, device=device) for _ in range(2))
    for out, at in ((first, starting), (last, ending)):
        out[list(at)] = torch.tensor(list(at.values()), dtype=torch.int64, device=device)
    return first, last, len(seq_chunks)


def chunk_fwd(q, k, v, g, beta, scale, initial_state, chunk_size, seq_chunks=None, keep_starts=True):
    """chunk.chunk_kda_fwd's contract, on the kernel: o (B, T, H, V), final (N, H, K, V), starts (B·H, NC, K, V)."""
    _require()
    B, T, H, K = q.shape
    C = chunk_size
    NC = -(-T // C)
    padded = [_padded(x, NC * C) for x in (q, k, v, g, beta)]
    first, last, N = _sequences(seq_chunks, NC, B, q.device)
    h0 = None if initial_state is None else initial_state.to(q.dtype).reshape(N, H, K, -1).contiguous()
    o, final, starts = torch.ops.k3_kda.chunk_fwd(*padded, float(scale), C, h0, first, last, N, keep_starts)
    return (o[:, :T] if NC * C != T else o), final, (starts if keep_starts else None)


def chunk_bwd(q, k, v, g, beta, starts, do, dfinal, scale, chunk_size, seq_chunks):
    """chunk_bwd.chunk_kda_bwd's contract, on the kernel: dq, dk, dv, dg, dβ in the inputs' shapes and dh0."""
    _require()
    B, T, H, K = q.shape
    C = chunk_size
    NC = starts.shape[1]
    padded = [_padded(x, NC * C) for x in (q, k, v, g, beta, do.to(q.dtype))]
    first, last, N = _sequences(seq_chunks, NC, B, q.device)
    dfinal = None if dfinal is None else dfinal.to(q.dtype).reshape(N, H, K, -1).contiguous()
    *grads, dh0 = torch.ops.k3_kda.chunk_bwd(
        *padded[:5], starts.contiguous(), padded[5], dfinal, float(scale), C, first, last, N
    )
    if NC * C != T:
        grads = [x[:, :T] for x in grads]
    return (*grads, dh0)
