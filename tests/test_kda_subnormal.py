"""No subnormal arithmetic in KDA (issue 28): every tensor the chunked forward, its hand-written backward and the
decode step produce is zero or normal in fp32, for gates at K3's bound and for unbounded ones down to −20; on the
PyTorch reference every intermediate, on the C++ kernel (one operator a pass) what it returns.

x86 BLAS and exp kernels run 10-70× slower on subnormal operands, and a process-wide flush-to-zero flag reaches
neither torch's OpenMP workers nor belongs to a library; so the op must never produce them. A TorchDispatchMode
inspects the output of every ATen op the call runs (views and uninitialised allocations excluded).
"""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from k3.ops.kda import chunk_kda, cpu_kernel, fused_recurrent_kda, naive_recurrent_kda

UNINITIALISED = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.new_empty.default,
}


class SubnormalCounter(TorchDispatchMode):
    """Counts, per ATen op, the subnormal values in the floating-point tensors it returns."""

    def __init__(self):
        super().__init__()
        self.found = collections.Counter()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in UNINITIALISED or any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        ):
            return out  # a view or fresh memory: its values were produced (and checked) elsewhere or not at all
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
                self.ops += 1
                n = int(((x != 0) & (x.abs() < torch.finfo(x.dtype).tiny)).sum())
                if n:
                    self.found[str(func)] += n
        return out


def gates(kind: str, T: int, H: int, K: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "bound":  # every channel at K3's bound: the steepest a bounded gate decays
        return torch.full((1, T, H, K), -5.0)
    if kind == "trained":  # −5·sigmoid(N(0, 1)), spread across the bound as a trained model's
        return -5 * torch.randn(1, T, H, K, generator=gen).sigmoid()
    if kind == "cliff":  # past fp32's range in one token: e^-120 alone is subnormal
        return -120 * torch.rand(1, T, H, K, generator=gen)
    # Kimi Linear's unbounded form −exp(A)·softplus(x), clipped at −20 per token
    A = torch.randn(H, K, generator=gen) + 1
    return (-A.exp() * F.softplus(torch.randn(1, T, H, K, generator=gen))).clamp(min=-20)


def inputs(kind: str, T: int = 300, H: int = 2, K: int = 32, V: int = 24):
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    beta = torch.randn(1, T, H, generator=gen).sigmoid()
    return q, k, v, gates(kind, T, H, K, gen), beta


@pytest.fixture(params=["reference", "kernel"])
def min_ops(request, monkeypatch) -> int:
    """Runs the test on the PyTorch reference and on the C++ kernel; the fewest ops the counter must see."""
    monkeypatch.setenv(cpu_kernel.ENV_VAR, "off" if request.param == "reference" else "auto")
    if request.param == "kernel" and not cpu_kernel.usable(torch.empty(0), 64):
        pytest.skip(cpu_kernel.describe())
    return 100 if request.param == "reference" else 3


@pytest.mark.parametrize("kind", ["bound", "trained", "unbounded", "cliff"])
def test_chunked_forward_and_backward_produce_no_subnormals(kind, min_ops):
    q, k, v, g, beta = inputs(kind)
    h0 = torch.randn(1, q.shape[2], q.shape[3], v.shape[3])
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    with SubnormalCounter() as fwd:
        o, S = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    with SubnormalCounter() as bwd:
        (o.square().sum() + S.square().sum()).backward()
    assert fwd.ops > min_ops and bwd.ops > min_ops, "the counter saw no work"
    assert not fwd.found, f"subnormal values in the forward: {dict(fwd.found)}"
    assert not bwd.found, f"subnormal values in the backward: {dict(bwd.found)}"
    # and the values are unchanged: still the recurrence, to fp32 accuracy. A cliff gate forgets the chunk's start
    # state within a token, and the WY form's u = U − W·S then cancels in fp32: 1.8e-5 for the state, as before the
    # floors (the per-token recurrence in fp32: 4e-8).
    tol = 1e-4 if kind == "cliff" else 1e-5
    with torch.no_grad():
        ref = naive_recurrent_kda(
            *(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double(), output_final_state=True
        )
    for got, want in zip((o, S), ref, strict=True):
        assert (got.detach().double() - want).norm() / want.norm() < tol


@pytest.mark.parametrize("kind", ["bound", "unbounded"])
def test_packed_prefill_with_chunk_states_produces_no_subnormals(kind, min_ops):
    """What a serving engine runs: packed sequences, inference mode, every chunk's state kept."""
    q, k, v, g, beta = inputs(kind, T=257)
    cu = torch.tensor([0, 70, 200, 257])
    with torch.inference_mode(), SubnormalCounter() as mode:
        chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, return_intermediate_states=True)
    assert mode.ops > min(min_ops, 50) and not mode.found, dict(mode.found)


@pytest.mark.parametrize("kind", ["bound", "unbounded", "cliff"])
def test_decode_steps_produce_no_subnormals(kind, monkeypatch):
    """Prefill, then 40 decode steps updating the state in place, as the engine does, on the torch path (whose
    ops the counter inspects; the C++ step floors its factors the same way and is compared with it elsewhere)."""
    monkeypatch.setattr(cpu_kernel, "step_usable", lambda *a: False)
    q, k, v, g, beta = inputs(kind, T=140)
    with torch.inference_mode():
        _, state = chunk_kda(q[:, :100], k[:, :100], v[:, :100], g[:, :100], beta[:, :100], output_final_state=True)
        with SubnormalCounter() as mode:
            for t in range(100, 140):
                step = (x[:, t : t + 1] for x in (q, k, v, g, beta))
                fused_recurrent_kda(*step, initial_state=state, inplace_final_state=True)
    assert mode.ops > 100 and not mode.found, dict(mode.found)
    assert not ((state != 0) & (state.abs() < torch.finfo(state.dtype).tiny)).any()


def test_the_counter_finds_subnormals():
    """The check can fail: the textbook split e^{G}·e^{−G} at the bound produces them."""
    with SubnormalCounter() as mode:
        G = torch.full((64, 16), -5.0).cumsum(0)
        torch.exp(G) @ torch.ones(16, 4)
    assert mode.found
