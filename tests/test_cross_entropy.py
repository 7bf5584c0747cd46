"""k3.ops.cross_entropy against torch's F.cross_entropy: value and gradient, ignored rows, bad targets."""

import pytest
import torch

import k3.ops.cross_entropy as ce_module
from k3.ops.cross_entropy import cross_entropy, reference


def _inputs(n: int, vocab: int, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g, dtype=dtype) * 3).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    return logits, targets


@pytest.mark.parametrize("n,vocab", [(2, 2), (7, 13), (33, 5)])
def test_value_and_gradient_match_torch(n, vocab):
    logits, targets = _inputs(n, vocab)
    targets[::3] = -100  # some rows without a target
    ours = cross_entropy(logits, targets)
    (g_ours,) = torch.autograd.grad(ours * 1.7, logits)
    theirs = reference(logits, targets)
    (g_theirs,) = torch.autograd.grad(theirs * 1.7, logits)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-13)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=1e-14)
    assert g_ours[::3].abs().max() == 0  # ignored rows get no gradient


def test_gradcheck():
    logits, targets = _inputs(5, 7, seed=1)
    targets[2] = -1
    assert torch.autograd.gradcheck(lambda z: cross_entropy(z, targets, ignore_index=-1), (logits,))


def test_fp32_close_to_float64():
    logits, targets = _inputs(64, 1000, seed=2)
    exact = cross_entropy(logits, targets)
    approx = cross_entropy(logits.detach().float().requires_grad_(), targets)
    assert abs(approx.item() - exact.item()) < 1e-5


def test_every_target_ignored_gives_nan_and_zero_gradient_like_torch():
    logits, _ = _inputs(4, 6)
    targets = torch.full((4,), -100)
    loss = cross_entropy(logits, targets)
    assert torch.isnan(loss) and torch.isnan(reference(logits, targets))
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad.abs().max() == 0


@pytest.mark.parametrize("bad", [7, -3])
def test_target_out_of_range_raises(bad):
    logits, targets = _inputs(4, 7)
    targets[1] = bad
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        cross_entropy(logits, targets)


def test_shape_mismatch_is_readable():
    logits, targets = _inputs(4, 7)
    with pytest.raises(ValueError, match=r"logits \(N, vocab\) and targets \(N,\)"):
        cross_entropy(logits, targets[:3])


def test_infinite_logits_behave_like_torch():
    """A row at -inf everywhere but its target (masked logits): the same loss and gradient as torch's."""
    logits, targets = _inputs(3, 6, seed=3)
    with torch.no_grad():
        logits[0] = float("-inf")
        logits[0, targets[0]] = 2.0
    for fn in (cross_entropy, reference):
        assert torch.isfinite(fn(logits, targets))
    torch.testing.assert_close(cross_entropy(logits, targets), reference(logits, targets), rtol=0, atol=1e-13)
    torch.testing.assert_close(
        torch.autograd.grad(cross_entropy(logits, targets), logits)[0],
        torch.autograd.grad(reference(logits, targets), logits)[0],
        rtol=0,
        atol=1e-14,
    )


def test_many_row_blocks_match_torch(monkeypatch):
    """The CPU path works in row blocks (about 4 MiB each); 2 rows a block covers every block boundary."""
    monkeypatch.setattr(ce_module, "_rows", lambda logits: 2)
    logits, targets = _inputs(9, 11, seed=4)
    targets[4] = -100
    ours, theirs = cross_entropy(logits, targets), reference(logits, targets)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-13)
    torch.testing.assert_close(
        torch.autograd.grad(ours, logits)[0], torch.autograd.grad(theirs, logits)[0], rtol=0, atol=1e-14
    )
