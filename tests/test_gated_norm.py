"""KDA's fused output gating (k3.model.gated_norm) equals rms_norm(x, w) · sigmoid(gate) in value and
gradient: float64 on odd shapes, gradcheck of every input, bf16, no graph under no_grad, and the tiny
K3Model's loss and every parameter gradient against the composed formula."""

import pytest
import torch

import k3.model.kda as kda_module
from k3.model.gated_norm import gated_rms_norm, gated_rms_norm_reference
from tiny_models import loss_and_grads, tiny_model

EPS = 1e-6


def rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()


def inputs(shape, seed=0):
    return (
        rand(*shape, seed=seed, scale=2.0),
        rand(shape[-1], seed=seed + 1).detach().add(1).requires_grad_(),
        rand(*shape, seed=seed + 2),
    )


@pytest.mark.parametrize("shape", [(2, 5, 3, 7), (1, 1, 1, 1), (3, 4, 2, 16)])
def test_equals_formula_and_gradchecks(shape):
    x, w, gate = inputs(shape)
    y = gated_rms_norm(x, w, gate, EPS)
    assert type(y.grad_fn).__name__ == "_GatedRMSNormBackward"
    y_ref = gated_rms_norm_reference(x, w, gate, EPS)
    torch.testing.assert_close(y, y_ref, rtol=1e-14, atol=1e-15)
    dy = rand(*shape, seed=9)
    grads = torch.autograd.grad(y, (x, w, gate), dy)
    grads_ref = torch.autograd.grad(y_ref, (x, w, gate), dy)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    assert torch.autograd.gradcheck(lambda *t: gated_rms_norm(*t, EPS), (x, w, gate))


def test_gradient_for_the_gate_only():
    x, w, gate = inputs((2, 5, 3, 7))
    x, w = x.detach(), w.detach()
    (dg,) = torch.autograd.grad(gated_rms_norm(x, w, gate, EPS).sum(), gate)
    (dg_ref,) = torch.autograd.grad(gated_rms_norm_reference(x, w, gate, EPS).sum(), gate)
    torch.testing.assert_close(dg, dg_ref, rtol=1e-12, atol=1e-13)


def test_no_grad_builds_no_graph_and_bad_shapes_are_named():
    x, w, gate = inputs((2, 5, 3, 7))
    with torch.no_grad():
        y = gated_rms_norm(x, w, gate, EPS)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, gated_rms_norm_reference(x, w, gate, EPS).detach(), rtol=1e-14, atol=1e-15)
    with pytest.raises(ValueError, match=r"gate \(2, 5, 3, 7\)"):
        gated_rms_norm(x, w, gate[..., :-1], EPS)
    with pytest.raises(ValueError, match=r"weight \(7,\)"):
        gated_rms_norm(x, w[:-1], gate, EPS)


def test_bf16_values_and_gradients():
    x64, w64, g64 = inputs((2, 5, 3, 16))
    x, w, gate = (t.detach().bfloat16().requires_grad_() for t in (x64, w64, g64))
    y = gated_rms_norm(x, w, gate, EPS)
    assert y.dtype == torch.bfloat16
    y_ref = gated_rms_norm_reference(x64, w64, g64, EPS)
    torch.testing.assert_close(y.double(), y_ref, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(y.float().sum(), (x, w, gate))
    grads_ref = torch.autograd.grad(y_ref.sum(), (x64, w64, g64))
    for got, want in zip(grads, grads_ref, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=5e-2)


def model_loss_and_grads(seed: int = 0):
    return loss_and_grads(tiny_model(seed), seed)


def test_tiny_model_loss_and_gradients_unchanged(monkeypatch):
    calls = []
    monkeypatch.setattr(kda_module, "gated_rms_norm", lambda *a: calls.append(1) or gated_rms_norm(*a))
    loss, grads = model_loss_and_grads()
    assert calls, "the model's KDA layers must gate through gated_rms_norm"
    monkeypatch.setattr(kda_module, "gated_rms_norm", gated_rms_norm_reference)
    loss_ref, grads_ref = model_loss_and_grads()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-12)
    assert grads.keys() == grads_ref.keys() and sum("o_norm" in n or "g_b_proj" in n for n in grads) >= 2
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-10, atol=1e-12, msg=name)
