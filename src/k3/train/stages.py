"""Staged context extension (SPEC §2.9) and the synthetic mix: which training batch each step reads.

K3 has no positional encoding, so the context grows by stages (the report: 8K -> 64K -> 256K -> 1M)
with nothing retuned between them. `--stages 256:100,1024:50,4096:20` trains the first 100 steps on
sequences of 256 tokens, the next 50 on 1,024, the next 20 on 4,096; a run with more --steps stays in
the last stage. Tokens per micro-batch stay those of --batch-size x --seq-len: a stage of length L reads
max(1, batch_size·seq_len // L) sequences, so a step costs about the same memory at every stage.

The data position counts sequences consumed; a stage reads the packed token stream cut at its own length,
in that length's seeded order, from the current position. Step and position (both in the checkpoint)
decide every batch, so a run resumed in the middle of a stage reads exactly what the unbroken run read.
"""

from dataclasses import dataclass

import torch

from k3.train.data import PackedSequences


@dataclass(frozen=True)
class Stage:
    seq_len: int
    steps: int


def parse_stages(text: str) -> list[Stage]:
    """'256:100,1024:50' -> [Stage(256, 100), Stage(1024, 50)]; a readable ValueError for anything else."""
    stages = []
    for part in text.split(","):
        try:
            length, steps = (int(x) for x in part.strip().split(":"))
        except ValueError:
            raise ValueError(
                f"--stages {text!r}: each stage is LENGTH:STEPS (e.g. 256:100,1024:50), got {part.strip()!r}"
            ) from None
        if length < 1 or steps < 1:
            raise ValueError(f"--stages {text!r}: lengths and steps must be at least 1, got {part.strip()!r}")
        stages.append(Stage(length, steps))
    return stages


def stage_at(stages: list[Stage], step: int) -> int:
    """The index of the stage that optimiser step `step` (0-based) trains in; past the end, the last."""
    end = 0
    for i, stage in enumerate(stages):
        end += stage.steps
        if step < end:
            return i
    return len(stages) - 1


class TrainBatches:
    """The micro-batch at (step, position): packed corpus sequences at the step's stage length, some of
    them replaced by synthetic examples (k3.data.synthetic.SyntheticMix) when a mix is given."""

    def __init__(self, base: PackedSequences, batch_size: int, stages: list[Stage] | None = None, mix=None):
        self.base, self.batch_size, self.mix = base, batch_size, mix
        self.stages = stages or []
        self._by_length = {base.seq_len: base}
        if mix is not None:  # a task that cannot fit a stage's length is refused now, not at that stage
            for length in {base.seq_len, *(s.seq_len for s in self.stages)}:
                mix.check_length(length)
        for stage in self.stages:
            if stage.seq_len > len(base.tokens):
                raise ValueError(
                    f"--stages: a stage of {stage.seq_len} tokens is longer than the training text "
                    f"({len(base.tokens)} tokens)"
                )

    def seq_len_at(self, step: int) -> int:
        return self.stages[stage_at(self.stages, step)].seq_len if self.stages else self.base.seq_len

    def rows_at(self, step: int) -> int:
        return stage_rows(self.batch_size, self.base.seq_len, self.seq_len_at(step))

    def batch(self, step: int, position: int) -> torch.Tensor:
        """(rows_at(step), seq_len_at(step)) int64 token ids for the data position `position`."""
        length = self.seq_len_at(step)
        if length not in self._by_length:
            self._by_length[length] = PackedSequences(self.base.tokens.numpy(), length, self.base.seed)
        batch = self._by_length[length].batch(position, self.rows_at(step))
        return batch if self.mix is None else self.mix.apply(batch, position)


def stage_rows(batch_size: int, seq_len: int, stage_len: int) -> int:
    """Rows of a micro-batch at a stage of `stage_len` tokens: the tokens of batch_size × seq_len, at least one."""
    return max(1, batch_size * seq_len // stage_len)
