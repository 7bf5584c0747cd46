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


# Inference over at most this many tokens (decode steps, short chunks) takes the stacked form of
# AttnResStream.input: a few ops over all sources at once instead of several per source.
STACK_TOKENS = 256


class AttnResStream:
    """Block AttnRes bookkeeping over depth: the completed blocks b₀ … b_{n−1} (b₀ the embedding) and
    `partial`, the sum of the sublayer outputs so far in the current block.

    The block rule: config.attn_res_blocks lists the layer index each block starts at. Entering such a
    layer closes the current block, whose partial sum becomes the next b_n, and starts an empty one;
    inside a block each sublayer's output is added to `partial`. Every sublayer input, and the final
    readout, is attn_res over the completed blocks and the partial sum (absent right after a block opens).
    """

    def __init__(self, embedding: torch.Tensor, block_starts: set[int]):
        self.blocks = [embedding]  # (B, T, d) each
        self.partial: torch.Tensor | None = None
        self.block_starts = block_starts
        # the completed blocks stacked (S, B, T, d) with 1 / rms of each (S, B, T): neither depends on
        # the sublayer's query, so they are built once per block, not once per sublayer
        self._stacked: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def begin_layer(self, index: int) -> None:
        if index in self.block_starts and self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None

    def input(self, query: tuple[nn.Linear, RMSNorm]) -> torch.Tensor:
        """The next sublayer's input under its pseudo-query (proj, norm): (B, T, d)."""
        x, single = self.blocks[0], len(self.blocks) == 1 and self.partial is None
        if single or torch.is_grad_enabled() or x.shape[0] * x.shape[1] > STACK_TOKENS:
            return attn_res(self.blocks if self.partial is None else [*self.blocks, self.partial], *query)
        return self._stacked_input(*query)

    def _stacked_input(self, proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
        """attn_res over the stacked completed blocks and the partial sum, the same sum in fewer ops."""
        if self._stacked is None or len(self._stacked[0]) != len(self.blocks) or self._stacked[2] != norm.eps:
            stack = torch.stack(self.blocks)
            sf = at_least_fp32(stack)
            self._stacked = stack, torch.rsqrt(sf.pow(2).mean(-1) + norm.eps), norm.eps
        stack, inv_rms, _ = self._stacked
        sf = at_least_fp32(stack)
        wg = (proj.weight[0] * norm.weight).to(sf.dtype)
        logits = (sf @ wg) * inv_rms  # (S, B, T)
        if self.partial is not None:
            pf = at_least_fp32(self.partial)
            last = (pf @ wg) * torch.rsqrt(pf.pow(2).mean(-1) + norm.eps)
            logits = torch.cat([logits, last[None]])
        weights = torch.softmax(logits, dim=0).to(stack.dtype)  # (S or S + 1, B, T)
        out = (stack * weights[: len(stack), ..., None]).sum(0)
        if self.partial is not None:
            out = torch.addcmul(out, self.partial, weights[-1, ..., None])
        return out

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out

    def summaries(self) -> list[torch.Tensor]:
        """The block summaries b₁ … b_final, (B, T, d) each (the final block is the partial sum at its end):
        what a speculative draft reads as the big model's low, mid and high features (k3.spec.draft)."""
        return [*self.blocks[1:], *([self.partial] if self.partial is not None else [])]

    readout = input
