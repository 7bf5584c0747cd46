"""The hand-written backwards of KDA's input flags (k3.ops.kda.gate): l2norm and the bounded forget gate
equal their formulas (`*_reference`) in value and gradient, in float64 on odd shapes, in bf16, without a
graph under no_grad, and inside a tiny K3Model (loss and every parameter gradient)."""

import pytest
import torch

import k3.ops.kda.inputs as kda_inputs
from k3.ops.kda.gate import kda_gate, kda_gate_reference, l2norm, l2norm_reference
from tiny_models import loss_and_grads, tiny_model

SHAPES = [(2, 5, 3, 7), (1, 1, 1, 1), (3, 4, 2, 16)]


def rand(*shape, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()


def gate_params(H, K, seed=1):
    return rand(H, seed=seed, scale=0.5), rand(H * K, seed=seed + 1)


@pytest.mark.parametrize("shape", SHAPES)
def test_l2norm_equals_formula_and_gradchecks(shape):
    x = rand(*shape)
    y = l2norm(x)
    assert type(y.grad_fn).__name__ == "_L2NormBackward"
    torch.testing.assert_close(y, l2norm_reference(x), rtol=1e-14, atol=1e-15)
    dy = rand(*shape, seed=3)
    dx = torch.autograd.grad(y, x, dy)[0]
    dx_ref = torch.autograd.grad(l2norm_reference(x), x, dy)[0]
    torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-13)
    assert torch.autograd.gradcheck(l2norm, (x,))


def test_l2norm_of_a_strided_view():
    """q and k reach l2norm as views of the convolution's output (a slice of the last dim)."""
    qkv = rand(2, 5, 3 * 14)
    x = qkv[..., 7:21].reshape(2, 5, 2, 7)
    assert not x.is_contiguous()
    torch.testing.assert_close(l2norm(x), l2norm_reference(x), rtol=1e-14, atol=1e-15)
    assert torch.autograd.gradcheck(lambda t: l2norm(t[..., 7:21].reshape(2, 5, 2, 7)), (qkv,))


@pytest.mark.parametrize("with_a_log", [True, False])
@pytest.mark.parametrize("dt_shape", ["flat", "HK", None])
@pytest.mark.parametrize("lower_bound", [-5.0, -0.7])
def test_bounded_gate_equals_formula_and_gradchecks(with_a_log, dt_shape, lower_bound):
    B, T, H, K = 2, 5, 3, 7
    g_raw = rand(B, T, H, K, scale=2.0)
    A_log, dt_bias = gate_params(H, K)
    A_log = A_log if with_a_log else None
    dt_bias = {"flat": dt_bias, "HK": dt_bias.detach().reshape(H, K).requires_grad_(), None: None}[dt_shape]
    inputs = [x for x in (g_raw, A_log, dt_bias) if x is not None]

    def fast(*_):
        return kda_gate(g_raw, A_log, dt_bias, lower_bound)

    y = fast()
    assert type(y.grad_fn).__name__ == "_BoundedGateBackward"
    y_ref = kda_gate_reference(g_raw, A_log, dt_bias, lower_bound)
    torch.testing.assert_close(y, y_ref, rtol=1e-14, atol=1e-15)
    dy = rand(B, T, H, K, seed=4)
    grads = torch.autograd.grad(y, inputs, dy)
    grads_ref = torch.autograd.grad(y_ref, inputs, dy)
    for got, want in zip(grads, grads_ref, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    assert torch.autograd.gradcheck(lambda g, *p: kda_gate(g, *_fill(p, A_log, dt_bias), lower_bound), inputs)


def _fill(params, A_log, dt_bias):
    """gradcheck passes only the tensors; put them back in the (A_log, dt_bias) slots that are not None."""
    it = iter(params)
    return (None if A_log is None else next(it)), (None if dt_bias is None else next(it))


def test_gate_grad_for_a_subset_of_inputs():
    """Only A_log needs a gradient (g_raw and dt_bias frozen): the others get none, A_log's is right."""
    g_raw = rand(2, 5, 3, 7).detach()
    A_log, dt_bias = gate_params(3, 7)
    dt_bias = dt_bias.detach()
    y = kda_gate(g_raw, A_log, dt_bias, -5.0)
    (dA,) = torch.autograd.grad(y.sum(), A_log)
    (dA_ref,) = torch.autograd.grad(kda_gate_reference(g_raw, A_log, dt_bias, -5.0).sum(), A_log)
    torch.testing.assert_close(dA, dA_ref, rtol=1e-12, atol=1e-13)


def test_unbounded_gate_stays_the_formula():
    g_raw = rand(2, 5, 3, 7)
    A_log, dt_bias = gate_params(3, 7)
    torch.testing.assert_close(kda_gate(g_raw, A_log, dt_bias, None), kda_gate_reference(g_raw, A_log, dt_bias, None))
    assert torch.autograd.gradcheck(lambda *xs: kda_gate(*xs, None), (g_raw, A_log, dt_bias))


def test_no_grad_builds_no_graph():
    x = rand(2, 5, 3, 7)
    A_log, dt_bias = gate_params(3, 7)
    with torch.no_grad():
        y, g = l2norm(x), kda_gate(x, A_log, dt_bias, -5.0)
    assert y.grad_fn is None and g.grad_fn is None and not y.requires_grad and not g.requires_grad
    torch.testing.assert_close(y, l2norm_reference(x).detach(), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(g, kda_gate_reference(x, A_log, dt_bias, -5.0).detach(), rtol=1e-14, atol=1e-15)
    with torch.inference_mode():
        torch.testing.assert_close(l2norm(x), l2norm_reference(x), rtol=1e-14, atol=1e-15)


def test_bf16_values_and_gradients():
    """bf16 in: l2norm gives bf16 (statistics in fp32), the gate fp32 (as the recurrence needs); both
    within bf16's rounding of the float64 formula, gradients in the inputs' dtypes."""
    x64 = rand(2, 5, 3, 16, scale=3.0)
    A_log, dt_bias = gate_params(3, 16)
    x = x64.detach().bfloat16().requires_grad_()
    y = l2norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), l2norm_reference(x.detach().double()), rtol=8e-3, atol=4e-3)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    (dx_ref,) = torch.autograd.grad(l2norm_reference(x64), x64, torch.ones_like(x64))
    assert dx.dtype == torch.bfloat16
    torch.testing.assert_close(dx.double(), dx_ref, rtol=2e-2, atol=2e-2)

    a32, d32 = (p.detach().float().requires_grad_() for p in (A_log, dt_bias))
    g = kda_gate(x, a32, d32, -5.0)
    assert g.dtype == torch.float32
    g_ref = kda_gate_reference(x.detach().double(), A_log, dt_bias, -5.0)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-5, atol=1e-5)
    dg_raw, dA, ddt = torch.autograd.grad(g.sum(), (x, a32, d32))
    dA_ref, ddt_ref = torch.autograd.grad(g_ref.sum(), (A_log, dt_bias))
    assert (dg_raw.dtype, dA.dtype, ddt.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    torch.testing.assert_close(dA.double(), dA_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ddt.double(), ddt_ref, rtol=1e-4, atol=1e-4)


def test_meta_device():
    x = torch.empty(2, 5, 3, 7, device="meta", requires_grad=True)
    a, d = torch.empty(3, device="meta", requires_grad=True), torch.empty(21, device="meta", requires_grad=True)
    grads = torch.autograd.grad((l2norm(x).sum() + kda_gate(x, a, d, -5.0).sum()), (x, a, d))
    assert [t.shape for t in grads] == [x.shape, a.shape, d.shape]


def model_loss_and_grads(seed: int = 0):
    return loss_and_grads(tiny_model(seed), seed)


def test_tiny_model_loss_and_gradients_unchanged(monkeypatch):
    calls = []
    monkeypatch.setattr(kda_inputs, "l2norm", lambda x: calls.append(1) or l2norm(x))
    loss, grads = model_loss_and_grads()
    assert calls, "the model's KDA layers must go through prepare's l2norm"
    monkeypatch.setattr(kda_inputs, "l2norm", l2norm_reference)
    monkeypatch.setattr(kda_inputs, "kda_gate", kda_gate_reference)
    loss_ref, grads_ref = model_loss_and_grads()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-12)
    assert grads.keys() == grads_ref.keys() and sum(n.endswith(("A_log", "dt_bias")) for n in grads) >= 2
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-10, atol=1e-12, msg=name)
