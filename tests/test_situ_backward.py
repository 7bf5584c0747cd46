"""`situ`'s hand-written forward and backward against the composed formula `situ_reference`."""

import pytest
import torch

import k3.model.situ as situ_module
from k3.model.situ import situ, situ_reference
from tiny_models import loss_and_grads, tiny_model

SHAPES = [(3, 5, 7), (2, 1, 13), (1,)]


def inputs(shape, dtype=torch.float64, seed=0):
    """g spans the sigmoid's and tanh's curved ranges; u reaches the soft cap at β₂ = 25."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen, dtype=torch.float64) * 6
    u = torch.randn(shape, generator=gen, dtype=torch.float64) * 40
    return g.to(dtype).requires_grad_(), u.to(dtype).requires_grad_()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("betas", [(4.0, 25.0), (1.5, 3.0)])
def test_forward_and_gradients_match_the_reference(shape, betas):
    g, u = inputs(shape)
    y = situ(g, u, *betas)
    y_ref = situ_reference(g, u, *betas)
    assert y.dtype == torch.float64 and y.grad_fn is not None
    torch.testing.assert_close(y, y_ref, rtol=1e-13, atol=1e-13)
    dy = torch.randn(shape, dtype=torch.float64)
    grads = torch.autograd.grad(y, (g, u), dy)
    grads_ref = torch.autograd.grad(y_ref, (g, u), dy)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_gradcheck(shape):
    g, u = inputs(shape, seed=1)
    assert torch.autograd.gradcheck(lambda g, u: situ(g, u, 4.0, 25.0), (g, u))


def test_gradient_of_one_input_only():
    g, u = inputs((4, 6), seed=2)
    u = u.detach()
    (dg,) = torch.autograd.grad(situ(g, u).sum(), g)
    (dg_ref,) = torch.autograd.grad(situ_reference(g, u).sum(), g)
    torch.testing.assert_close(dg, dg_ref, rtol=1e-12, atol=1e-12)


def test_fp32_is_as_close_to_float64_as_the_reference():
    g, u = inputs((64, 48), seed=3)
    dy = torch.randn(64, 48, dtype=torch.float64)
    exact = (situ_reference(g, u), *torch.autograd.grad(situ_reference(g, u), (g, u), dy))
    g32, u32 = (t.detach().float().requires_grad_() for t in (g, u))
    for f in (situ, situ_reference):
        y32 = f(g32, u32)
        got = (y32, *torch.autograd.grad(y32, (g32, u32), dy.float()))
        errors = [(a.double() - b).abs().max().item() / b.abs().max().item() for a, b in zip(got, exact, strict=True)]
        if f is situ:
            assert all(a.dtype == torch.float32 for a in got)
            fast_errors = errors
    assert all(e < 1e-6 for e in fast_errors), fast_errors
    assert all(fast <= 4 * ref + 1e-7 for fast, ref in zip(fast_errors, errors, strict=True)), (fast_errors, errors)


def test_bf16_computes_in_fp32_and_returns_bf16():
    g, u = inputs((8, 32), dtype=torch.bfloat16, seed=4)
    dy = torch.randn(8, 32).bfloat16()
    y = situ(g, u)
    dg, du = torch.autograd.grad(y, (g, u), dy)
    g32, u32 = (t.detach().float().requires_grad_() for t in (g, u))
    y32 = situ_reference(g32, u32)
    dg32, du32 = torch.autograd.grad(y32, (g32, u32), dy.float())
    assert y.dtype == dg.dtype == du.dtype == torch.bfloat16
    # one bf16 rounding of the fp32 result, not bf16 arithmetic
    torch.testing.assert_close(y, y32.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(dg, dg32.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(du, du32.bfloat16(), rtol=1e-2, atol=1e-2)


def test_no_grad_builds_no_graph_and_matches():
    g, u = inputs((5, 9), seed=5)
    with torch.no_grad():
        y = situ(g, u)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, situ_reference(g, u).detach(), rtol=1e-13, atol=1e-13)


def model_loss_and_grads(seed: int = 0):
    return loss_and_grads(tiny_model(seed), seed)


def test_tiny_model_loss_and_gradients_unchanged(monkeypatch):
    loss, grads = model_loss_and_grads()
    monkeypatch.setattr(situ_module, "situ", situ_reference)
    loss_ref, grads_ref = model_loss_and_grads()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-12)
    assert grads.keys() == grads_ref.keys() and len(grads) > 20
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-10, atol=1e-12, msg=name)


def test_broadcasting_operands_take_the_formula():
    g = torch.randn(1, 6, dtype=torch.float64, requires_grad=True)
    u = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    y = situ(g, u)
    torch.testing.assert_close(y, situ_reference(g, u), rtol=0, atol=0)
    assert torch.autograd.gradcheck(situ, (g, u))
