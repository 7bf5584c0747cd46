"""Bad input gets a ValueError that names the tensor and the expected shape; the gate and the backend
switch behave as documented."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate, l2norm
from k3.ops.kda.backend import ENV_VAR, resolve
from kda_inputs import make_inputs

B, T, H, K, V = 1, 10, 2, 16, 8


def good():
    q, k, v, g, beta = make_inputs(B, T, H, K, V, dtype=torch.float32)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


BAD = [
    ("q rank", dict(q=torch.randn(T, H, K)), r"q must be \[B, T, H, K\]"),
    ("k shape", dict(k=torch.randn(B, T, H, K + 1)), r"k must have the shape of q"),
    ("v time", dict(v=torch.randn(B, T + 1, H, V)), r"v must be \[B, T, HV, V\]"),
    ("v heads", dict(v=torch.randn(B, T, 3, V)), r"multiple of q's H"),
    ("g layout", dict(g=torch.randn(B, H, T, K)), r"g must be \[B, T, HV, K\] = \[1, 10, 2, 16\]"),
    ("beta shape", dict(beta=torch.rand(B, T, H, 1)), r"beta must be \[B, T, HV\] = \[1, 10, 2\]"),
    ("int dtype", dict(v=torch.ones(B, T, H, V, dtype=torch.int64)), r"v must be a floating-point tensor"),
    ("state shape", dict(initial_state=torch.zeros(B, H, V, K)), r"initial_state must be \[N, HV, K, V\]"),
    ("lower bound", dict(use_gate_in_kernel=True, lower_bound=-6.0), r"lower_bound must be in \[-5.0, 0\)"),
    ("lower bound 0", dict(use_gate_in_kernel=True, lower_bound=0.0), r"lower_bound must be in"),
    ("gate no A_log", dict(use_gate_in_kernel=True), r"needs A_log"),
    ("neg eigval", dict(allow_neg_eigval=True), r"needs use_beta_sigmoid_in_kernel"),
]


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
@pytest.mark.parametrize(("case", "change", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_problem(fn, case, change, message):
    with pytest.raises(ValueError, match=message):
        fn(**{**good(), **change})


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_cu_seqlens_checks(fn):
    x = good()
    with pytest.raises(ValueError, match="packed into B = 1"):
        fn(**{k: torch.cat([t, t]) for k, t in x.items()}, cu_seqlens=torch.tensor([0, 5, 10]))
    with pytest.raises(ValueError, match="rise from 0 to T = 10"):
        fn(**x, cu_seqlens=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match="rise from 0 to T = 10"):
        fn(**x, cu_seqlens=torch.tensor([0, 5, 9]))
    with pytest.raises(ValueError, match="int32/int64"):
        fn(**x, cu_seqlens=torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match=r"N = number of sequences"):
        fn(**x, cu_seqlens=torch.tensor([0, 5, 10]), initial_state=torch.zeros(3, H, K, V))


def test_chunk_size_and_pool_checks():
    # fla's kernels take 32 or 64 and raise otherwise; the torch path agrees rather than accepting more
    for size in (16, 40, 128):
        with pytest.raises(ValueError, match=r"chunk_size must be one of \(32, 64\)"):
            chunk_kda(**good(), chunk_size=size)
    with pytest.raises(ValueError, match=r"ssm_state_indices must lie in \[0, 2\)"):
        fused_recurrent_kda(**good(), initial_state=torch.zeros(2, H, K, V), ssm_state_indices=torch.tensor([2]))
    with pytest.raises(ValueError, match="needs an initial_state"):
        fused_recurrent_kda(**good(), inplace_final_state=True)


def test_backend_switch(monkeypatch):
    x = torch.zeros(1)
    assert resolve(None, x) == "torch"  # auto on CPU
    assert resolve("torch", x) == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve("triton", x)
    with pytest.raises(ValueError, match="kernels run on cuda tensors and these are on cpu"):
        chunk_kda(**good(), backend="fla")
    monkeypatch.setenv(ENV_VAR, "nope")
    with pytest.raises(ValueError, match=f"{ENV_VAR} must be one of"):
        chunk_kda(**good())
    monkeypatch.setenv(ENV_VAR, "torch")
    assert chunk_kda(**good())[0].shape == (B, T, H, V)


def test_gate_formulas():
    g_raw = torch.randn(3, 5, H, K, dtype=torch.float64)
    A_log = torch.randn(H, dtype=torch.float64)
    dt_bias = torch.randn(H, K, dtype=torch.float64)
    x = g_raw + dt_bias
    bounded = kda_gate(g_raw, A_log, dt_bias.flatten(), -5.0)
    assert torch.allclose(bounded, -5.0 * torch.sigmoid(A_log.exp()[:, None] * x))
    unbounded = kda_gate(g_raw, A_log, dt_bias, None)
    assert torch.allclose(unbounded, -A_log.exp()[:, None] * F.softplus(x))
    assert torch.allclose(kda_gate(g_raw, None, None, -2.0), -2.0 * torch.sigmoid(g_raw))
    with pytest.raises(ValueError, match="needs A_log"):
        kda_gate(g_raw, None, None, None)
    with pytest.raises(ValueError, match="dt_bias must have H\\*K = 32"):
        kda_gate(g_raw, A_log, torch.zeros(K), -5.0)


@settings(max_examples=50, deadline=None)
@given(st.floats(-1e4, 1e4), st.floats(-3, 3), st.sampled_from([-5.0, -1.0, -0.1]))
def test_bounded_gate_stays_in_range(raw, a_log, lower_bound):
    g = kda_gate(torch.full((1, 1, 1), raw, dtype=torch.float64), torch.tensor([a_log]), None, lower_bound)
    assert lower_bound <= g.item() <= 0


def test_l2norm():
    x = torch.randn(4, 7, dtype=torch.float64)
    assert torch.allclose(l2norm(x), x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6))
    assert l2norm(x.bfloat16()).dtype == torch.bfloat16
