"""Packed fixed-length training sequences with a deterministic, resumable order.

Documents are tokenised, joined with the end-of-text token between them, and cut into sequences of
seq_len tokens. The order is a seeded permutation per epoch, so the whole data position is one
integer (sequences consumed so far) that a checkpoint stores.
"""

from pathlib import Path

import numpy as np
import torch

from k3.formats.files import atomic_write
from k3.formats.tokenizer import K3Tokenizer
from k3.train.corpus import Document


def pack(docs: list[Document], tokenizer: K3Tokenizer) -> np.ndarray:
    """All documents as one int32 token stream, each followed by the end-of-text token."""
    ids = tokenizer.encode_batch([d.text for d in docs])
    out = np.empty(sum(len(x) + 1 for x in ids), dtype=np.int32)
    pos = 0
    for x in ids:
        out[pos : pos + len(x)] = x
        out[pos + len(x)] = tokenizer.eos_id
        pos += len(x) + 1
    return out


def cached_pack(path: Path, docs: list[Document], tokenizer: K3Tokenizer) -> np.ndarray:
    """pack(), stored as .npy in the run directory so a resumed run reads exactly the same tokens."""
    if path.exists():
        return np.load(path, allow_pickle=False)
    tokens = pack(docs, tokenizer)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save would add ".npy" to a name
            np.save(f, tokens, allow_pickle=False)

    atomic_write(path, write)
    return tokens


class PackedSequences:
    """tokens (N,) -> batches (B, seq_len) of int64, in a seeded per-epoch order."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0):
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        self.seq_len, self.seed = seq_len, seed
        self.num_sequences = len(tokens) // seq_len
        if self.num_sequences == 0:
            raise ValueError(f"{len(tokens)} tokens do not fill one sequence of {seq_len}")
        self._epoch, self._order = -1, None

    def order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_sequences, generator=gen)
        return self._order

    def batch(self, position: int, batch_size: int) -> torch.Tensor:
        """The batch_size sequences starting at data position `position` (crossing epochs as needed)."""
        rows = []
        for p in range(position, position + batch_size):
            i = self.order(p // self.num_sequences)[p % self.num_sequences].item()
            rows.append(self.tokens[i * self.seq_len : (i + 1) * self.seq_len])
        return torch.stack(rows)

    def fixed_batches(self, count: int, batch_size: int) -> list[torch.Tensor]:
        """The first count·batch_size sequences in file order: a stable validation set."""
        n = min(count * batch_size, self.num_sequences)
        seqs = self.tokens[: n * self.seq_len].view(n, self.seq_len)
        return [seqs[i : i + batch_size] for i in range(0, n, batch_size)]
