"""The hand-written backwards of KDA's input flags (k3.ops.kda.gate): l2norm equals its formula
(`l2norm_reference`) in value and gradient, in float64 on odd shapes, in bf16, without a
graph under no_grad, and inside a tiny K3Model (loss and every parameter gradient)."""

import pytest
import torch

import k3.ops.kda.inputs as kda_inputs
from k3.ops.kda.gate import l2norm, l2norm_reference
from tiny_models import tiny_model

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


def test_no_grad_builds_no_graph():
    x = rand(2, 5, 3, 7)
    with torch.no_grad():
        y = l2norm(x)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, l2norm_reference(x).detach(), rtol=1e-14, atol=1e-15)
    with torch.inference_mode():
        torch.testing.assert_close(l2norm(x), l2norm_reference(x), rtol=1e-14, atol=1e-15)


def test_bf16_values_and_gradients():
    """bf16 in, bf16 out (statistics in fp32), within bf16's rounding of the float64 formula."""
    x64 = rand(2, 5, 3, 16, scale=3.0)
    x = x64.detach().bfloat16().requires_grad_()
    y = l2norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), l2norm_reference(x.detach().double()), rtol=8e-3, atol=4e-3)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    (dx_ref,) = torch.autograd.grad(l2norm_reference(x64), x64, torch.ones_like(x64))
    assert dx.dtype == torch.bfloat16
    torch.testing.assert_close(dx.double(), dx_ref, rtol=2e-2, atol=2e-2)


def test_meta_device():
    x = torch.empty(2, 5, 3, 7, device="meta", requires_grad=True)
    (dx,) = torch.autograd.grad(l2norm(x).sum(), x)
    assert dx.shape == x.shape


def model_loss_and_grads(seed: int = 0):
    model = tiny_model(seed).train()
    ids = torch.randint(0, 512, (2, 19), generator=torch.Generator().manual_seed(seed))
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_tiny_model_loss_and_gradients_unchanged(monkeypatch):
    calls = []
    monkeypatch.setattr(kda_inputs, "l2norm", lambda x: calls.append(1) or l2norm(x))
    loss, grads = model_loss_and_grads()
    assert calls, "the model's KDA layers must go through prepare's l2norm"
    monkeypatch.setattr(kda_inputs, "l2norm", l2norm_reference)
    loss_ref, grads_ref = model_loss_and_grads()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-12)
    assert grads.keys() == grads_ref.keys() and sum("q_proj" in n for n in grads) >= 1
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-10, atol=1e-12, msg=name)
