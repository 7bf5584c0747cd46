"""What one engine step computes, decided once by the scheduler and executed as is by the model runner.

A step is a list of prefill pieces and a list of decode rows. Each carries everything the forward
needs (token ids, positions, page tables, KDA checkpoint pages to fill), copied from its Sequence
when the plan was made, so the runner never reads or changes scheduling state. Progress
(`num_computed_tokens`), checkpoint commits and sampling happen after the forward, from the plan.
"""

from dataclasses import dataclass, field
from typing import ClassVar

from k3.serve.sequence import Sequence


@dataclass(frozen=True)
class PrefillPiece:
    """Tokens start … start + len(token_ids) − 1 of one request, computed in this step.

    A request's prefill of one step may be split into pieces at checkpoint positions: `phase` is the
    piece's index among them (0, 1, …), and pieces of one request run in phase order inside each layer.
    checkpoint_pages: n_kda pages (KDA layer order) reserved in the prefix cache that receive the
    request's KDA state and conv tails after the piece's last token; None when no checkpoint ends here.
    sample: the piece ends at the request's last token, so its logits are returned and sampled.
    """

    seq: Sequence
    start: int
    token_ids: tuple[int, ...]
    latent_pages: tuple[int, ...]  # page table covering at least start + len(token_ids) tokens
    state_pages: tuple[int, ...]  # one page per KDA layer, in layer order
    phase: int = 0
    checkpoint_pages: tuple[int, ...] | None = None
    sample: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def num_logits(self) -> int:
        """Positions whose logits the runner returns: the last one when sampled."""
        return int(self.sample)


@dataclass(frozen=True)
class DecodeRow:
    """The last token of a request whose earlier tokens are all computed: one token, always sampled.

    Read by the runner through the same fields as a PrefillPiece (start, token_ids, pages, phase,
    checkpoint_pages, sample)."""

    seq: Sequence
    start: int  # = the token's position, seq.num_tokens − 1 when planned
    token_ids: tuple[int]
    latent_pages: tuple[int, ...]
    state_pages: tuple[int, ...]
    phase: ClassVar[int] = 0
    checkpoint_pages: ClassVar[None] = None
    sample: ClassVar[bool] = True
    num_tokens: ClassVar[int] = 1
    num_logits: ClassVar[int] = 1

    @property
    def end(self) -> int:
        return self.start + 1


@dataclass(frozen=True)
class ProposalRow:
    """A decoding request's last token and the draft's k proposals after it (speculative decoding): k + 1
    tokens from position `start` = seq.num_tokens − 1, each one's logits returned, so the big model scores
    every proposal in this step's one forward. Its KDA states are rolled back afterwards to the last
    accepted token (k3.serve.model_runner.ModelRunner.rollback)."""

    seq: Sequence
    start: int
    token_ids: tuple[int, ...]  # (last token, proposal 1, …, proposal k)
    latent_pages: tuple[int, ...]  # covering start + k + 1 tokens
    state_pages: tuple[int, ...]
    phase: ClassVar[int] = 0
    checkpoint_pages: ClassVar[None] = None
    sample: ClassVar[bool] = True

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_logits(self) -> int:
        return len(self.token_ids)

    @property
    def proposals(self) -> tuple[int, ...]:
        return self.token_ids[1:]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def prefill_piece(
    seq: Sequence, start: int, end: int, phase: int = 0, checkpoint_pages: list[int] | None = None
) -> PrefillPiece:
    """The piece computing seq's tokens start … end − 1 from its current page tables; sampled when it
    ends at seq's last token."""
    if not 0 <= start < end <= seq.num_tokens:
        raise ValueError(f"a piece needs 0 <= start < end <= {seq.num_tokens} tokens of {seq!r}, got {start}, {end}")
    return PrefillPiece(
        seq,
        start,
        tuple(seq.token_ids(start, end)),
        tuple(seq.latent_pages),
        tuple(seq.state_pages),
        phase,
        tuple(checkpoint_pages) if checkpoint_pages is not None else None,
        sample=end == seq.num_tokens,
    )


def decode_row(seq: Sequence, num_proposals: int = 0) -> DecodeRow | ProposalRow:
    """The row decoding seq's last token (every earlier token computed); with num_proposals > 0 the
    proposal row of that token and the first num_proposals of seq.draft_token_ids."""
    if seq.num_computed_tokens != seq.num_tokens - 1:
        raise ValueError(f"a decode row needs every token but the last computed, got {seq!r}")
    if num_proposals:
        tokens = (seq.last_token_id, *seq.draft_token_ids[:num_proposals])
        return ProposalRow(seq, seq.num_tokens - 1, tokens, tuple(seq.latent_pages), tuple(seq.state_pages))
    return DecodeRow(seq, seq.num_tokens - 1, (seq.last_token_id,), tuple(seq.latent_pages), tuple(seq.state_pages))


@dataclass
class StepPlan:
    """One step: prefill pieces (a request's pieces adjacent, in phase order), then decode rows.
    preempted: requests the scheduler took back while planning (their pages are released)."""

    prefill: list[PrefillPiece] = field(default_factory=list)
    decode: list[DecodeRow | ProposalRow] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def pieces(self) -> list[PrefillPiece | DecodeRow | ProposalRow]:
        return [*self.prefill, *self.decode]

    @property
    def sampled(self) -> list[PrefillPiece | DecodeRow | ProposalRow]:
        """The pieces whose logits the runner returns, in its output's row order: num_logits rows each
        (the last token's; every token's of a proposal row)."""
        return [p for p in self.pieces if p.sample]

    @property
    def proposal_rows(self) -> list[ProposalRow]:
        return [p for p in self.decode if isinstance(p, ProposalRow)]

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.pieces)

    @property
    def checkpoint_pages(self) -> list[int]:
        """Every page reserved for a checkpoint in this step."""
        return [page for p in self.prefill if p.checkpoint_pages is not None for page in p.checkpoint_pages]
