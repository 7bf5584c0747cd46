"""The short causal convolution's fast path (hand-written backward) against its composite reference, in float64."""

import pytest
import torch

import k3.model.kda as kda_module
from k3.config import K3Config
from k3.model.cache import KDALayerCache
from k3.model.kda import KimiDeltaAttention
from k3.model.short_conv import causal_conv, causal_conv_reference

TINY = K3Config.from_preset("tiny")
B, C = 3, 7


def inputs(T: int, w: int, with_tail: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 100 * T + 10 * w + with_tail)
    x = torch.randn(B, T, C, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(C, 1, w, generator=gen, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(B, C, w - 1, generator=gen, dtype=torch.float64, requires_grad=True) if with_tail else None
    return x, weight, tail


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("with_tail", [False, True])
@pytest.mark.parametrize("w", [1, 2, 3, 4])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 17])
def test_matches_reference_forward_and_every_gradient(T, w, with_tail):
    x, weight, tail = inputs(T, w, with_tail)
    y, new_tail = causal_conv(x, weight, tail)
    y_ref, new_tail_ref = causal_conv_reference(x, weight, tail)
    assert rel_err(y, y_ref) < 1e-14
    assert new_tail.shape == (B, C, w - 1) and torch.equal(new_tail, new_tail_ref)
    dy = torch.randn(B, T, C, dtype=torch.float64)
    leaves = [t for t in (x, weight, tail) if t is not None]
    grads = torch.autograd.grad(y, leaves, dy)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert rel_err(g, g_ref) < 1e-13


@pytest.mark.parametrize(
    ("T", "w", "with_tail"), [(2, 4, True), (3, 4, False), (5, 3, True), (17, 4, True), (5, 1, False)]
)
def test_gradcheck(T, w, with_tail):
    x, weight, tail = inputs(T, w, with_tail, seed=1)
    assert torch.autograd.gradcheck(lambda *a: causal_conv(*a)[0], (x, weight, tail))


def test_only_weight_or_only_x_needs_grad():
    x, weight, tail = inputs(5, 4, True, seed=2)
    for leaf, other in ((x, weight), (weight, x)):
        y = causal_conv(x.detach() if leaf is weight else x, weight.detach() if leaf is x else weight, tail.detach())[0]
        (g,) = torch.autograd.grad(y.sum(), [leaf])
        (g_ref,) = torch.autograd.grad(causal_conv_reference(x, weight, tail)[0].sum(), [leaf])
        assert rel_err(g, g_ref) < 1e-13 and other.grad is None


def test_decoding_step_is_the_reference_exactly():
    x, weight, tail = inputs(1, 4, True, seed=3)
    with torch.no_grad():
        y, new_tail = causal_conv(x, weight, tail)
        y_ref, new_tail_ref = causal_conv_reference(x, weight, tail)
    assert torch.equal(y, y_ref) and torch.equal(new_tail, new_tail_ref)


def test_chunks_with_tails_equal_one_call():
    x, weight, _ = inputs(17, 4, False, seed=4)
    with torch.no_grad():
        full, _ = causal_conv(x, weight, None)
        pieces, tail = [], None
        for lo, hi in ((0, 2), (2, 3), (3, 9), (9, 17)):  # a piece shorter than the tail, a decode step, longer
            y, tail = causal_conv(x[:, lo:hi], weight, tail)
            pieces.append(y)
    assert rel_err(torch.cat(pieces, 1), full) < 1e-14
    assert torch.equal(tail, x[:, -3:].transpose(1, 2))


def test_new_tail_is_a_small_copy():
    """A cache keeping the tail must not keep the whole (B, T, C) input alive."""
    x, weight, _ = inputs(17, 4, False, seed=5)
    _, tail = causal_conv(x, weight, None)
    assert tail.untyped_storage().nbytes() == B * C * 3 * x.element_size()


def test_bad_shapes_raise_readable_errors():
    x, weight, tail = inputs(5, 4, True, seed=6)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv(x, weight[:-1], tail)
    with pytest.raises(ValueError, match="tail must be"):
        causal_conv(x, weight, tail[..., :2])


def randomized_layer() -> KimiDeltaAttention:
    """float64, every parameter random, so no term of the layer can hide."""
    gen = torch.Generator().manual_seed(0)
    layer = KimiDeltaAttention(TINY).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return layer


def run_layer(layer: KimiDeltaAttention, x: torch.Tensor, pieces: list[int] | None):
    """Outputs (uncached, or piece by piece through a cache) and every gradient of a fixed loss."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    if pieces is None:
        out = layer(x)
    else:
        cache, outs, lo = KDALayerCache(), [], 0
        for n in pieces:
            outs.append(layer(x[:, lo : lo + n], cache))
            lo += n
        out = torch.cat(outs, 1)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pieces", [None, [7, 1, 5, 6]])
def test_whole_kda_layer_matches_composite_convolution(monkeypatch, pieces):
    layer = randomized_layer()
    x = torch.randn(2, 19, TINY.hidden_size, dtype=torch.float64)
    out, dx, grads = run_layer(layer, x, pieces)
    monkeypatch.setattr(kda_module, "causal_conv", causal_conv_reference)
    out_ref, dx_ref, grads_ref = run_layer(layer, x, pieces)
    assert rel_err(out, out_ref) < 1e-12 and rel_err(dx, dx_ref) < 1e-12
    assert grads.keys() == grads_ref.keys()
    assert {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"} <= grads.keys()
    for name, g in grads.items():
        assert rel_err(g, grads_ref[name]) < 1e-12, name
