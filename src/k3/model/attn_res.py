"""Block Attention Residuals (SPEC §2.5): softmax attention over depth instead of a running sum.

Before each sublayer its input is

    h = Σ_n softmax_n(w · RMSNorm(v_n)) · v_n      over v ∈ [b₀, b₁, …, b_{n−1}, partial]

b₀ the token embedding, b_i the sum of the sublayer outputs of completed block i, `partial` the
running sum inside the current block (absent before the block's first sublayer). w is the
sublayer's pseudo-query, zero-initialised so every source starts with equal weight, with its own
RMSNorm gain. The softmax over sources is taken in fp32; the weights sum to one, so the hidden
state's scale stays bounded with depth.

Training runs it as one autograd Function with a hand-written backward. With g = w ⊙ γ, a_s = v_s · g,
r_s = 1/rms(v_s), logit_s = a_s · r_s, p = softmax_s(logit), h = Σ_s p_s v_s and dh the incoming gradient:

    dp_s = dh · v_s,   dl_s = p_s (dp_s − Σ_t p_t dp_t)
    dv_s = p_s dh + dl_s r_s g − dl_s a_s r_s³ / d · v_s,   dg = Σ_{tokens, s} dl_s r_s v_s
    dw = dg ⊙ γ,   dγ = dg ⊙ w

Autograd through the composed form ran ~10 small ops per source and as many backward nodes (mv, pow, mean,
rsqrt, mul, addcmul, each with its own pass over v); the Function saves only references to the sources
(the stream keeps them alive anyway) and three (S, B, T) rows of statistics.

Inference runs the same forward, so a served model computes its trained function bit for bit (a stacked
form for short inputs, a few percent faster per decode step and another summation order, was removed:
docs/benchmarks.md, "Block AttnRes at inference"); the stream only computes each completed block's 1/rms
once for all the sublayers that read it.
"""

from collections.abc import Sequence

import torch
from torch import nn

from k3.model.norm import RMSNorm
from k3.ops.autograd import first_derivative_only
from k3.ops.numerics import at_least_fp32, inverse_norm


def attn_res_reference(sources: list[torch.Tensor], proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """The equation as written, autograd through every op: the spec `attn_res` is tested against.
    sources: S tensors (B, T, d) -> (B, T, d)."""
    vf = at_least_fp32(torch.stack(sources))  # (S, B, T, d)
    normed = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.to(vf.dtype)
    logits = normed @ proj.weight[0].to(vf.dtype)  # (S, B, T): w · RMSNorm(v_s)
    weights = torch.softmax(logits, dim=0)
    return (weights[..., None] * vf).sum(0).to(sources[0].dtype)


def attn_res(
    sources: list[torch.Tensor], proj: nn.Linear, norm: RMSNorm, inv_rms: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """sources: S tensors (B, T, d) -> (B, T, d). proj: the pseudo-query w as a (d -> 1) linear map,
    norm: its key RMSNorm (`*_res_proj`, `*_res_norm` in the released checkpoint).

    w · RMSNorm(v) = (v · (w ⊙ γ)) / rms(v): one dot product and one mean square per source, with no
    stacked (S, B, T, d) copy and no normalised copy of every source.

    inv_rms: 1/rms of the first len(inv_rms) sources, (B·T,) each (`source_inv_rms`), when the caller keeps
    them: they do not depend on the query, so AttnResStream computes a completed block's once for all the
    sublayers that read it. Inference only (no autograd graph); the values are the ones computed here.
    """
    if len(sources) == 1:
        return sources[0]
    d = sources[0].shape[-1]
    if any(v.shape != sources[0].shape for v in sources) or proj.weight.shape != (1, d) or norm.weight.shape != (d,):
        shapes = ", ".join(str(tuple(v.shape)) for v in sources)
        raise ValueError(
            f"attn_res needs sources of one shape (..., d) and a (1, d) query with a (d,) norm gain: got sources "
            f"{shapes}, query {tuple(proj.weight.shape)}, gain {tuple(norm.weight.shape)}"
        )
    if torch.is_grad_enabled() and (
        proj.weight.requires_grad or norm.weight.requires_grad or any(v.requires_grad for v in sources)
    ):
        if len(inv_rms):
            raise ValueError("attn_res: inv_rms is for inference; the training Function computes every 1/rms itself")
        return _AttnRes.apply(proj.weight, norm.weight, norm.eps, *sources)
    return _forward(proj.weight, norm.weight, norm.eps, sources, inv_rms)[0]


def source_inv_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, T, d) -> (B·T,) 1/rms(v) in at least fp32, through k3.ops.numerics like every RMSNorm of the model."""
    return inverse_norm(at_least_fp32(v).reshape(-1, v.shape[-1]), eps, mean=True)[:, 0]


def _forward(weight, gamma, eps, sources, inv_rms=()):
    """-> h (B, T, d) in the sources' dtype (summed in at least fp32), and p, a, r (S, B·T) in at least fp32
    (see the module docstring).
    inv_rms: r of the first sources, when the caller has them (attn_res)."""
    d = sources[0].shape[-1]
    v0 = at_least_fp32(sources[0])
    g = (weight[0] * gamma).to(v0.dtype)
    a = v0.new_empty(len(sources), v0.numel() // d)
    for s, v in enumerate(sources):
        torch.linalg.vecdot(at_least_fp32(v).reshape(-1, d), g, out=a[s])  # 1.6x faster than mv here
    r = torch.stack([*inv_rms, *(source_inv_rms(v, eps) for v in sources[len(inv_rms) :])])
    # over the sources as a softmax along each token's row of S logits: along dim 0 of (S, N) torch vectorises
    # across tokens and sends those in the vector tail through a scalar exp, so equal tokens at other places of
    # a packed batch got other last bits (a request's log-probabilities depended on its batch neighbours)
    p = torch.softmax((a * r).T, dim=-1).T  # (S, N) in fp32 (or fp64)
    # the weighted sum in fp32, rounded to the sources' dtype once, as HF's, TensorRT-LLM's and SGLang's K3 code
    # sum it: in bf16 each of up to S products and partial sums rounds to 8 bits (a no-op for fp32 sources)
    pv = p.reshape(len(sources), *sources[0].shape[:-1], 1)
    h = torch.mul(at_least_fp32(sources[0]), pv[0])
    for v, ps in zip(sources[1:], pv[1:], strict=True):
        h.addcmul_(v, ps)
    return h.to(sources[0].dtype), p, a, r


class _AttnRes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, gamma, eps, *sources):
        h, p, a, r = _forward(weight, gamma, eps, sources)
        ctx.save_for_backward(weight, gamma, p, a, r, *sources)
        return h

    @staticmethod
    @first_derivative_only  # written with in-place ops for one backward
    def backward(ctx, dh):
        weight, gamma, p, a, r, *sources = ctx.saved_tensors
        d = dh.shape[-1]
        dhf = at_least_fp32(dh).reshape(-1, d)
        # dp_s = dh · v_s, as a product written into what becomes dv_s and a sum: mul + sum beat vecdot and bmm
        dv = [torch.mul(dhf, at_least_fp32(v).reshape(-1, d)) for v in sources]
        dp = torch.stack([x.sum(-1) for x in dv])  # (S, N)
        dl = p * (dp - (p * dp).sum(0))
        c1 = dl * r  # the coefficient of g, and of v_s in dg
        c2 = c1 * a * r * r / -d  # the coefficient of v_s through r_s
        g = (weight[0] * gamma).to(dhf.dtype)
        dg = g.new_zeros(1, d)
        grads = []
        for s, v in enumerate(sources):
            vf = at_least_fp32(v).reshape(-1, d)
            dg.addmm_(c1[s : s + 1], vf)  # as a (1, N) @ (N, d) product: 1.4x faster than addmv over vf.T
            if ctx.needs_input_grad[3 + s]:
                x = torch.mul(dhf, p[s, :, None], out=dv[s])
                x.addcmul_(vf, c2[s, :, None]).addr_(c1[s], g)
                grads.append(x.to(v.dtype).reshape(v.shape))
            else:
                grads.append(None)
        dweight = (dg * gamma.to(dg.dtype)).to(weight.dtype) if ctx.needs_input_grad[0] else None
        dgamma = (dg[0] * weight[0].to(dg.dtype)).to(gamma.dtype) if ctx.needs_input_grad[1] else None
        return dweight, dgamma, None, *grads


class ResidualStream:
    """The plain residual stream of the `residual="standard"` ablation: every sublayer reads x and adds
    its output to it. Same interface as AttnResStream, so a decoder layer runs either."""

    def __init__(self, x: torch.Tensor):
        self.x = x  # (B, T, d)

    def begin_layer(self, index: int) -> None:
        """Nothing to do: a plain residual has no blocks."""

    def input(self, query: tuple[nn.Linear, RMSNorm] | None = None) -> torch.Tensor:
        return self.x

    def add(self, out: torch.Tensor) -> None:
        self.x = self.x + out

    readout = input


class AttnResStream:
    """Block AttnRes bookkeeping over depth: the completed blocks b₀ … b_{n−1} (b₀ the embedding) and
    `partial`, the sum of the sublayer outputs so far in the current block.

    The block rule: config.attn_res_blocks lists the layer index each block starts at. Entering such a
    layer closes the current block, whose partial sum becomes the next b_n, and starts an empty one;
    inside a block each sublayer's output is added to `partial`. Every sublayer input, and the final
    readout, is attn_res over the completed blocks and the partial sum (absent right after a block opens).

    One form in training and inference, so a served model computes its trained function bit for bit: at
    inference the completed blocks' 1/rms, which do not depend on the sublayer's query, are computed once per
    block (`_inv_rms`) instead of once per sublayer, the same values attn_res would compute.
    """

    def __init__(self, embedding: torch.Tensor, block_starts: set[int]):
        self.blocks = [embedding]  # (B, T, d) each
        self.partial: torch.Tensor | None = None
        self.block_starts = block_starts
        self._inv_rms: list[torch.Tensor] = []  # (B·T,) 1/rms of blocks[i], filled at inference as blocks complete
        self._inv_rms_eps: float | None = None

    def begin_layer(self, index: int) -> None:
        if index in self.block_starts and self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None

    def input(self, query: tuple[nn.Linear, RMSNorm]) -> torch.Tensor:
        """The next sublayer's input under its pseudo-query (proj, norm): (B, T, d)."""
        sources = self.blocks if self.partial is None else [*self.blocks, self.partial]
        if torch.is_grad_enabled() or len(sources) == 1:
            return attn_res(sources, *query)
        return attn_res(sources, *query, inv_rms=self._block_inv_rms(query[1].eps))

    def _block_inv_rms(self, eps: float) -> list[torch.Tensor]:
        """1/rms of every completed block (attn_res's inv_rms), each computed once."""
        if eps != self._inv_rms_eps:
            self._inv_rms, self._inv_rms_eps = [], eps
        while len(self._inv_rms) < len(self.blocks):
            self._inv_rms.append(source_inv_rms(self.blocks[len(self._inv_rms)], eps))
        return self._inv_rms

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out

    def summaries(self) -> list[torch.Tensor]:
        """The block summaries b₁ … b_final, (B, T, d) each (the final block is the partial sum at its end):
        what a speculative draft reads as the big model's low, mid and high features (k3.spec.draft)."""
        return [*self.blocks[1:], *([self.partial] if self.partial is not None else [])]

    readout = input
