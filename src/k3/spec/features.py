"""The big model's features a draft reads (SPEC §3): AttnRes block summaries, low, mid and high.

K3 has Block AttnRes over blocks of 12 layers; the draft reads the summaries of blocks 1, 4 and the
final one (b₁, b₄, b_final: each the sum of its sublayers' outputs). A preset with fewer than five
blocks has no block 4 short of the final one, so the draft reads the first, the middle and the last
(the small and tiny presets have three blocks: all three).

The summaries are taken from the forward the engine (or the trainer) runs anyway: the stream a decoder
layer receives is the model's one AttnResStream, so a pre-hook on the last layer holds it, and after
the forward its completed blocks and final partial sum are the summaries. Nothing in the model changes.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from k3.config import K3Config
from k3.model.attn_res import AttnResStream
from k3.model.model import K3Model


def feature_blocks(config: K3Config) -> tuple[int, int, int]:
    """1-based indices of the block summaries the draft reads: (1, 4, final), or (first, middle, last)
    for presets with fewer than five blocks."""
    if config.residual != "attnres":
        raise ValueError("a K3 draft reads AttnRes block summaries; this model has standard residuals")
    n = len(config.attn_res_blocks)
    return (1, 4, n) if n >= 5 else (1, (n + 1) // 2, n)


class SummaryCapture:
    """Holds the AttnResStream of the model's latest forward; `summaries(blocks)` reads it afterwards."""

    def __init__(self) -> None:
        self.stream: AttnResStream | None = None

    def hook(self, module, args) -> None:
        self.stream = args[0]

    def summaries(self, blocks: tuple[int, ...]) -> list[torch.Tensor]:
        """The chosen block summaries of the latest forward, (B, T, d) each."""
        if self.stream is None:
            raise RuntimeError("no forward has run inside block_summaries()")
        all_blocks = self.stream.summaries()
        return [all_blocks[b - 1] for b in blocks]


@contextmanager
def block_summaries(model: K3Model) -> Iterator[SummaryCapture]:
    """Within the context, every forward of `model` leaves its AttnRes stream in the yielded capture."""
    feature_blocks(model.config)
    capture = SummaryCapture()
    handle = model.model.layers[-1].register_forward_pre_hook(capture.hook)
    try:
        yield capture
    finally:
        handle.remove()
