"""`attn_res`'s hand-written forward and backward against the literal equation `attn_res_reference`, and the
tiny model's loss and gradients against the autograd-composed form it replaced."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from k3.model import attn_res as attn_res_module
from k3.model.attn_res import AttnResStream, attn_res, attn_res_reference
from k3.model.norm import RMSNorm
from k3.ops.numerics import at_least_fp32
from tiny_models import loss_and_grads, tiny_model

B, T, D = 2, 5, 7


def attn_res_before(sources: list[torch.Tensor], proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """attn_res as it was before the hand-written backward: autograd through per-source mv, pow, mean, rsqrt."""
    if len(sources) == 1:
        return sources[0]
    wg = proj.weight[0] * norm.weight
    logits = []
    for v in sources:
        vf = at_least_fp32(v)
        logits.append((vf @ wg.to(vf.dtype)) * torch.rsqrt(vf.pow(2).mean(-1) + norm.eps))
    weights = torch.softmax(at_least_fp32(torch.stack(logits)), dim=0).to(sources[0].dtype)
    out = sources[0] * weights[0].unsqueeze(-1)
    for v, w in zip(sources[1:], weights[1:], strict=True):
        out = torch.addcmul(out, v, w.unsqueeze(-1))
    return out


def inputs(n_sources: int, dtype=torch.float64, seed=0, eps=1e-6):
    """Sources with per-row scales over three decades (rms differs token to token, so the r_s term matters),
    a query large enough that the softmax is far from uniform, and a non-trivial norm gain."""
    gen = torch.Generator().manual_seed(seed)
    sources = []
    for _ in range(n_sources):
        scale = 10 ** torch.empty(B, T, 1, dtype=torch.float64).uniform_(-1.5, 1.5, generator=gen)
        sources.append((torch.randn(B, T, D, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_())
    proj, norm = nn.Linear(D, 1, bias=False).to(dtype), RMSNorm(D, eps).to(dtype)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(1, D, generator=gen, dtype=torch.float64))
        norm.weight.copy_(torch.empty(D, dtype=torch.float64).uniform_(0.3, 2.0, generator=gen))
    return sources, proj, norm


@pytest.mark.parametrize("n_sources", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_forward_and_gradients_match_the_reference(n_sources, eps):
    sources, proj, norm = inputs(n_sources, seed=n_sources, eps=eps)
    h, h_ref = attn_res(sources, proj, norm), attn_res_reference(sources, proj, norm)
    assert h.dtype == torch.float64 and h.shape == (B, T, D)
    torch.testing.assert_close(h, h_ref, rtol=1e-13, atol=1e-13)
    dh = torch.randn(B, T, D, dtype=torch.float64)
    params = [*sources, proj.weight, norm.weight]
    got = torch.autograd.grad(h, params, dh, allow_unused=True)
    want = torch.autograd.grad(h_ref, params, dh)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if n_sources == 1 and i > 0:  # one source: h = v, the query does not enter
            assert g is None and w.abs().max() == 0
        else:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=f"gradient {i}")


@pytest.mark.parametrize("n_sources", [2, 3, 5])
def test_gradcheck_every_source_and_both_weights(n_sources):
    sources, proj, norm = inputs(n_sources, seed=10 + n_sources)
    w, g = proj.weight.detach().requires_grad_(), norm.weight.detach().requires_grad_()

    def f(w, g, *sources):  # attn_res reads proj.weight, norm.weight and norm.eps only
        return attn_res(list(sources), SimpleNamespace(weight=w), SimpleNamespace(weight=g, eps=1e-6))

    assert torch.autograd.gradcheck(f, (w, g, *sources))


def test_gradient_of_some_inputs_only():
    sources, proj, norm = inputs(4, seed=20)
    sources[1] = sources[1].detach()
    proj.weight.requires_grad_(False)
    params = [sources[0], *sources[2:], norm.weight]
    got = torch.autograd.grad(attn_res(sources, proj, norm).square().sum(), params)
    want = torch.autograd.grad(attn_res_reference(sources, proj, norm).square().sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_stream_under_autograd_equals_the_reference():
    sources, proj, norm = inputs(3, seed=30)
    stream = AttnResStream(sources[0], block_starts={1, 2})
    for layer in range(3):
        stream.begin_layer(layer)
        for _ in range(2):  # two sublayers a layer, with and without a partial sum
            partial = [stream.partial] if stream.partial is not None else []
            want = attn_res_reference([*stream.blocks, *partial], proj, norm)
            got = stream.input((proj, norm))
            assert got.requires_grad
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
            stream.add(torch.randn(B, T, D, dtype=torch.float64) + got)
    assert len(stream.blocks) == 3
    (got,) = torch.autograd.grad(stream.readout((proj, norm)).sum(), sources[0])
    assert got.abs().max() > 0


def test_stream_follows_a_change_of_eps():
    sources, proj, norm = inputs(3, seed=35)
    stream = AttnResStream(sources[0], block_starts={1, 2})
    for layer, v in enumerate(sources[1:], start=1):
        stream.add(v)
        stream.begin_layer(layer)
    assert len(stream.blocks) == 3 and stream.partial is None
    for eps in (1e-6, 30.0, 1e-6):
        norm.eps = eps
        torch.testing.assert_close(stream.input((proj, norm)), attn_res_reference(sources, proj, norm))


def test_bf16_sources_statistics_in_fp32():
    sources, proj, norm = inputs(4, seed=40)
    proj, norm = proj.float(), norm.float()  # fp32 parameters, bf16 activations: the mixed-precision case
    with torch.no_grad():  # sources close in direction under a large query: logits ~50 apart by ~1, where bf16
        # logits or statistics (steps of 0.25 there) would move the weights by far more than the tolerance
        proj.weight.mul_(20)
        common = torch.randn(B, T, D, generator=torch.Generator().manual_seed(41), dtype=torch.float64)
        common *= torch.sign(common @ (proj.weight[0] * norm.weight).double())[..., None]
        sources = [(common * v.abs().mean() + 0.03 * v).bfloat16().requires_grad_() for v in sources]
    h = attn_res(sources, proj, norm)
    dh = torch.randn(B, T, D).bfloat16()
    grads = torch.autograd.grad(h, [*sources, proj.weight, norm.weight], dh)
    sources32 = [v.detach().float().requires_grad_() for v in sources]
    h32 = attn_res_reference(sources32, proj, norm)
    grads32 = torch.autograd.grad(h32, [*sources32, proj.weight, norm.weight], dh.float())
    assert h.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads[:4])
    assert grads[4].dtype == grads[5].dtype == torch.float32
    # the fp32 result up to the bf16 rounding of the weights, the products and the output; not bf16 statistics
    for got, want in [(h, h32), *zip(grads, grads32, strict=True)]:
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_no_grad_path_gives_the_same_values():
    sources, proj, norm = inputs(3, seed=50)
    with torch.no_grad():
        h = attn_res(sources, proj, norm)
    assert h.grad_fn is None and h.equal(attn_res(sources, proj, norm).detach())


def test_mismatched_shapes_raise_a_readable_error():
    sources, proj, norm = inputs(3, seed=60)
    with pytest.raises(ValueError, match=r"got sources \(2, 5, 7\), \(2, 5, 7\), \(2, 4, 7\)"):
        attn_res([*sources[:2], sources[2][:, :4]], proj, norm)
    with pytest.raises(ValueError, match=r"query \(1, 6\), gain \(7,\)"):
        attn_res(sources, nn.Linear(6, 1, bias=False).double(), norm)


def model_loss_and_grads(seed: int = 0):
    model = tiny_model(seed)
    with torch.no_grad():  # non-trivial key-norm gains, so their gradient path is exercised
        for name, p in model.named_parameters():
            if "_res_norm" in name:
                p.uniform_(0.5, 1.5)
    return loss_and_grads(model, seed)


def test_tiny_model_loss_and_gradients_unchanged(monkeypatch):
    loss, grads = model_loss_and_grads()
    monkeypatch.setattr(attn_res_module, "attn_res", attn_res_before)
    loss_ref, grads_ref = model_loss_and_grads()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-12)
    assert grads.keys() == grads_ref.keys() and sum("_res_" in n for n in grads) >= 10
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_sources", [2, 3, 5])
def test_a_tokens_output_does_not_depend_on_its_place_in_the_batch(n_sources, dtype):
    """Equal tokens anywhere in a packed batch get bit-equal outputs, forward and backward. The softmax over
    sources ran along dim 0 of (S, N), which torch vectorises across tokens with the vector tail through
    another exp: two requests with one prompt had logits that differed in the last bits (issue 26;
    test_structured_engine's test_logprobs_are_the_raw_model_distribution)."""
    torch.manual_seed(0)
    for n in (35, 37, 67, 131):  # a tail past every vector width (4, 8, 16 lanes)
        place = torch.randint(0, 3, (n,))  # every token is one of three, in every position
        distinct = [torch.randn(3, 64, dtype=dtype) for _ in range(n_sources)]
        sources = [v[place][None].requires_grad_() for v in distinct]  # (1, n, 64)
        proj, norm = nn.Linear(64, 1, bias=False).to(dtype), RMSNorm(64).to(dtype)
        with torch.no_grad():
            proj.weight.normal_()
        h = attn_res(sources, proj, norm)
        h.pow(2).sum().backward()
        for out in (h[0].detach(), *(v.grad[0] for v in sources)):
            for token in range(3):
                rows = out[place == token]
                assert (rows == rows[0]).all(), (n, token)
