"""Block Attention Residuals (SPEC §2.5): softmax attention over depth instead of a running sum.

Before each sublayer its input is

    h = Σ_n softmax_n(w · RMSNorm(v_n)) · v_n      over v ∈ [b₀, b₁, …, b_{n−1}, partial]

b₀ the token embedding, b_i the sum of the sublayer outputs of completed block i, `partial` the
running sum inside the current block (absent before the block's first sublayer). w is the
sublayer's pseudo-query, zero-initialised so every source starts with equal weight, with its own
RMSNorm gain. The softmax over sources is taken in fp32; the weights sum to one, so the hidden
state's scale stays bounded with depth.
"""

import torch
from torch import nn

from k3.model.norm import RMSNorm
from k3.ops.numerics import at_least_fp32


def attn_res(sources: list[torch.Tensor], proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """sources: S tensors (B, T, d) -> (B, T, d). proj: the pseudo-query w as a (d -> 1) linear map,
    norm: its key RMSNorm (`*_res_proj`, `*_res_norm` in the released checkpoint).

    w · RMSNorm(v) = (v · (w ⊙ γ)) / rms(v): one dot product and one mean square per source, with no
    stacked (S, B, T, d) copy and no normalised copy of every source, which dominated this function's
    cost when it was written literally.
    """
    if len(sources) == 1:
        return sources[0]
    wg = proj.weight[0] * norm.weight  # (d,)
    logits = []
    for v in sources:
        vf = at_least_fp32(v)
        logits.append((vf @ wg.to(vf.dtype)) * torch.rsqrt(vf.pow(2).mean(-1) + norm.eps))  # (B, T)
    weights = torch.softmax(at_least_fp32(torch.stack(logits)), dim=0).to(sources[0].dtype)  # (S, B, T)
    out = sources[0] * weights[0].unsqueeze(-1)
    for v, w in zip(sources[1:], weights[1:], strict=True):
        out = torch.addcmul(out, v, w.unsqueeze(-1))
    return out
