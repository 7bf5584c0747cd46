"""Random KDA inputs and the comparison metric shared by the KDA tests."""

import torch
import torch.nn.functional as F

from k3.ops.kda import kda_gate


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ (RMS ratio), the per-tensor error measure of fla's tests."""
    return ((x - ref).double().pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(B, T, H, K, V, HV=None, dtype=torch.float64, seed=0, raw=False, lower_bound=-5.0):
    """q, k, v, g, beta as a model would produce them: unit-norm q and k, g = the bounded gate of a
    random projection, beta in (0, 1). raw=True returns pre-activation g and beta logits with
    unnormalised q, k, for the in-kernel flags."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    g_raw = torch.randn(B, T, HV, K, generator=gen, dtype=dtype)
    beta_raw = torch.randn(B, T, HV, generator=gen, dtype=dtype)
    if raw:
        return q, k, v, g_raw, beta_raw
    A_log = torch.zeros(HV, dtype=dtype)
    g = kda_gate(g_raw, A_log, None, lower_bound).to(dtype)
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, beta_raw.sigmoid()


def random_state(N, HV, K, V, dtype=torch.float64, seed=1):
    return torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def grads_of(fn, tensors, seed=2):
    """Run fn(*tensors) -> (o, state), backprop random cotangents, return (o, state, grads)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    o, S = fn(*leaves)
    # cotangents drawn in fp64 on the CPU, then cast and moved: the same values for every dtype and device
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype)).sum()
    if S is not None:
        loss = loss + (S * torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.device, S.dtype)).sum()
    loss.backward()
    return o.detach(), None if S is None else S.detach(), [None if t is None else t.grad for t in leaves]
