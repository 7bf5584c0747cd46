"""`rms_norm`'s hand-written forward and backward against the composed formula `rms_norm_reference`."""

import pytest
import torch

from k3 import K3Config, K3Model
from k3.model.norm import RMSNorm, rms_norm, rms_norm_reference
from tiny_models import loss_and_grads, tiny_model

SHAPES = [(3, 5, 7), (2, 1, 13), (1, 4), (2, 3, 2, 5)]


def inputs(shape, dtype=torch.float64, seed=0):
    """x with a per-row scale spread over three decades, so rstd differs row to row; weight random."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10 ** torch.empty(*shape[:-1], 1, dtype=torch.float64).uniform_(-1.5, 1.5, generator=gen)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    w = torch.randn(shape[-1], generator=gen, dtype=torch.float64)
    return x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_forward_and_gradients_match_the_reference(shape, eps):
    x, w = inputs(shape)
    y, y_ref = rms_norm(x, w, eps), rms_norm_reference(x, w, eps)
    assert y.dtype == torch.float64 and y.grad_fn is not None
    torch.testing.assert_close(y, y_ref, rtol=1e-13, atol=1e-13)
    dy = torch.randn(shape, dtype=torch.float64)
    grads, grads_ref = torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(y_ref, (x, w), dy)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_gradcheck(shape):
    x, w = inputs(shape, seed=1)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, w))


@pytest.mark.parametrize("which", [0, 1])
def test_gradient_of_one_input_only(which):
    x, w = inputs((4, 6), seed=2)
    args = [x, w]
    args[1 - which] = args[1 - which].detach()
    (got,) = torch.autograd.grad(rms_norm(*args, 1e-6).square().sum(), args[which])
    (want,) = torch.autograd.grad(rms_norm_reference(*args, 1e-6).square().sum(), args[which])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_fp32_is_as_close_to_float64_as_the_reference():
    x, w = inputs((16, 8, 96), seed=3)
    dy = torch.randn(16, 8, 96, dtype=torch.float64)
    exact = (rms_norm_reference(x, w, 1e-6), *torch.autograd.grad(rms_norm_reference(x, w, 1e-6), (x, w), dy))
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
    errors = {}
    for f in (rms_norm, rms_norm_reference):
        y32 = f(x32, w32, 1e-6)
        got = (y32, *torch.autograd.grad(y32, (x32, w32), dy.float()))
        assert all(a.dtype == torch.float32 for a in got)
        errors[f] = [
            (a.double() - b).abs().max().item() / b.abs().max().item() for a, b in zip(got, exact, strict=True)
        ]
    assert all(e < 1e-6 for e in errors[rms_norm]), errors
    assert all(f <= 4 * r + 1e-7 for f, r in zip(errors[rms_norm], errors[rms_norm_reference], strict=True)), errors


def test_bf16_statistics_in_fp32_and_dtypes_kept():
    x, w = inputs((4, 3, 64), dtype=torch.bfloat16, seed=4)
    dy = torch.randn(4, 3, 64).bfloat16()
    y = rms_norm(x, w, 1e-6)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
    y32 = rms_norm_reference(x32, w32, 1e-6)
    dx32, dw32 = torch.autograd.grad(y32, (x32, w32), dy.float())
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    # one bf16 rounding of the fp32 result (or its neighbour), not bf16 arithmetic
    for got, want in [(y, y32), (dx, dx32), (dw, dw32)]:
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_module_keeps_its_parameter_eps_and_no_grad_path():
    norm = RMSNorm(13, eps=1e-5).double()
    assert [n for n, _ in norm.named_parameters()] == ["weight"] and norm.eps == 1e-5
    with torch.no_grad():
        norm.weight.normal_()
        x = inputs((2, 1, 13), seed=5)[0].detach()
        y = norm(x)
    assert y.grad_fn is None
    torch.testing.assert_close(y, rms_norm_reference(x, norm.weight, 1e-5).detach(), rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match="weight \\(13,\\), not \\(12,\\)"):
        norm(torch.ones(2, 12, dtype=torch.float64))


def test_meta_device_model_builds_and_its_norms_run():
    """Loaders and the parameter count build K3Model on the meta device; the norms must run there too."""
    with torch.device("meta"):
        model = K3Model(K3Config.from_preset("tiny"))
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) > 5 and all(m.weight.device.type == "meta" for m in norms)
    norm = norms[0]
    x = torch.empty(2, 3, norm.weight.shape[0], device="meta", requires_grad=True)
    y = norm(x)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), torch.empty_like(y))
    assert y.device.type == dx.device.type == dw.device.type == "meta" and dw.shape == norm.weight.shape


def model_loss_and_grads(seed: int = 0):
    return loss_and_grads(tiny_model(seed), seed)


def test_tiny_model_loss_and_gradients_unchanged(monkeypatch):
    loss, grads = model_loss_and_grads()
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: rms_norm_reference(x, self.weight, self.eps))
    loss_ref, grads_ref = model_loss_and_grads()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-12)
    assert grads.keys() == grads_ref.keys() and sum("norm" in n for n in grads) > 5
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-10, atol=1e-12, msg=name)
