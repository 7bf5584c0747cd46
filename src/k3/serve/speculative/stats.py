"""Counters of speculative decoding: how many proposals were verified and accepted, per draft position."""

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """verify_steps: proposal rows run; proposed / accepted: proposals verified and accepted; per position j
    (0-based), proposed_at[j] / accepted_at[j]. A verify step emits accepted + 1 tokens."""

    verify_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"accepted {num_accepted} of {num_proposed} proposals")
        grow = num_proposed - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        self.verify_steps += 1
        self.proposed += num_proposed
        self.accepted += num_accepted
        for j in range(num_proposed):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < num_accepted

    def __add__(self, other: "SpecStats") -> "SpecStats":
        """The counters of two runs together."""
        n = max(len(self.proposed_at), len(other.proposed_at))

        def pad(xs: list[int]) -> list[int]:
            return xs + [0] * (n - len(xs))

        return SpecStats(
            self.verify_steps + other.verify_steps,
            self.proposed + other.proposed,
            self.accepted + other.accepted,
            [a + b for a, b in zip(pad(self.proposed_at), pad(other.proposed_at), strict=True)],
            [a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at), strict=True)],
        )

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a verify step emits (accepted proposals + the big model's own token)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def acceptance_at(self) -> list[float]:
        """Per draft position: the share of proposals there that were accepted."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at, strict=True)]

    def as_dict(self) -> dict:
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
        }
