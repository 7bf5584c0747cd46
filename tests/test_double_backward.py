"""The hand-written backwards compute first derivatives only: asking for a second one (create_graph=True)
raises (k3.ops.autograd.first_derivative_only), where before some returned silently wrong values (their
backwards treat saved statistics such as 1/rms as constants) and others dropped out of the graph."""

import pytest
import torch
from torch import nn

from k3.model.attn_res import attn_res
from k3.model.gated_norm import gated_rms_norm
from k3.model.norm import rms_norm
from k3.model.short_conv import causal_conv
from k3.model.situ import situ
from k3.ops.cross_entropy import cross_entropy
from k3.ops.kda.gate import kda_gate, l2norm


def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()


CASES = {
    "rms_norm": lambda x: rms_norm(x, torch.rand(7, dtype=torch.float64) + 0.5, 1e-6),
    "gated_rms_norm": lambda x: gated_rms_norm(x, torch.rand(7, dtype=torch.float64) + 0.5, _x(3, 5, 7, seed=1), 1e-6),
    "l2norm": l2norm,
    "kda_gate": lambda x: kda_gate(x, _x(5, seed=8), _x(35, seed=9), -5.0),
    "situ": lambda x: situ(x, _x(3, 5, 7, seed=2)),
    "short_conv": lambda x: causal_conv(x, _x(7, 1, 4, seed=3), None)[0],
    "attn_res": lambda x: attn_res(
        [x, _x(3, 5, 7, seed=4)],
        nn.Linear(7, 1, bias=False).double(),
        type("Norm", (), {"weight": torch.ones(7, dtype=torch.float64), "eps": 1e-6})(),
    ),
    "cross_entropy": lambda x: cross_entropy(x.reshape(15, 7), torch.arange(15) % 7),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_second_derivative_raises(name):
    x = _x(3, 5, 7)
    y = CASES[name](x)
    (dx,) = torch.autograd.grad((y * y).sum(), x, retain_graph=True)  # the first derivative is there
    assert dx.shape == x.shape and dx.abs().sum() > 0
    with pytest.raises(RuntimeError, match="k3 computes this first derivative by hand"):
        torch.autograd.grad((y * y).sum(), x, create_graph=True)


def test_chunk_kda_second_derivative_raises():
    from k3.ops.kda import chunk_kda

    q, k, v = _x(1, 6, 2, 4, seed=5), _x(1, 6, 2, 4, seed=6), _x(1, 6, 2, 4, seed=7)
    g = -torch.rand(1, 6, 2, 4, dtype=torch.float64)
    beta = torch.rand(1, 6, 2, dtype=torch.float64)
    o, _ = chunk_kda(q, k, v, g, beta)
    with pytest.raises(RuntimeError, match="k3 computes this first derivative by hand"):
        torch.autograd.grad(o.square().sum(), q, create_graph=True)
