"""Perplexity of a model on a user's text (`k3 eval --model DIR --data PATH`).

The text is tokenised as training packs it: each file's tokens followed by the end-of-text token, all
files one stream in sorted path order. The stream of N tokens is cut into windows: window i reads tokens
[i·L, (i+1)·L] (L + 1 of them, the last window fewer) and predicts every token of it but the first, so
each of the N - 1 tokens after the first is predicted exactly once, from the context of its window
(L = seq_len). Full windows run batch_size at a time; the shorter last window runs alone, so no padding
token is ever in a forward. Negative log-likelihoods are summed in float64; perplexity is
exp(sum / N - 1).
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DEFAULT_SEQ_LEN = 512


class EvalDataError(ValueError):
    """The --data path holds no text to score."""


@dataclass
class TextFiles:
    """The UTF-8 text files under a path, and what was passed over."""

    names: list[str]  # relative to the folder (a file's own name for a single file), sorted
    texts: list[str]
    not_utf8: list[str]  # skipped: not UTF-8, or binary (a NUL byte)
    empty: list[str]  # skipped: no bytes


def read_texts(path: str | Path) -> TextFiles:
    """Every non-empty UTF-8 text file at `path` (one file, or every file below a folder)."""
    root = Path(path)
    if not root.exists():
        raise EvalDataError(f"--data {root}: no such file or folder")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    found = TextFiles([], [], [], [])
    for file in files:
        name = file.name if file == root else file.relative_to(root).as_posix()
        try:
            data = file.read_bytes()
        except OSError as e:
            raise EvalDataError(f"--data {file}: cannot be read ({e.strerror})") from e
        if not data:
            found.empty.append(name)
            continue
        try:
            if b"\0" in data:
                raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "NUL byte")
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            found.not_utf8.append(name)
            continue
        found.names.append(name)
        found.texts.append(text)
    if not found.texts:
        if not files:
            raise EvalDataError(f"--data {root}: the folder holds no files")
        raise EvalDataError(
            f"--data {root}: no text to score ({len(found.empty)} empty, {len(found.not_utf8)} not UTF-8 text, "
            f"of {len(files)} file{'s' if len(files) != 1 else ''})"
        )
    return found


def token_stream(texts: list[str], tokenizer) -> list[int]:
    """The texts as one token stream, each followed by the end-of-text token (as training packs them)."""
    stream: list[int] = []
    for ids in tokenizer.encode_batch(texts):
        stream += [*ids, tokenizer.eos_id]
    return stream


def windows(num_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, end) token ranges, end exclusive: each reads end - start tokens and predicts all but the first;
    together they predict tokens 1 .. num_tokens - 1 once each."""
    return [(s, min(s + seq_len + 1, num_tokens)) for s in range(0, num_tokens - 1, seq_len)]


@torch.no_grad()
def score_tokens(model: torch.nn.Module, ids: list[int], seq_len: int, batch_size: int) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, tokens predicted) of a token stream under the model."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
    device = next(model.parameters()).device
    tokens = torch.tensor(ids, dtype=torch.long, device=device)
    spans = windows(len(ids), seq_len)
    short = spans[-1:] if spans and spans[-1][1] - spans[-1][0] < seq_len + 1 else []  # only the last can be
    full = spans[: len(spans) - len(short)]
    groups = [full[i : i + batch_size] for i in range(0, len(full), batch_size)] + [short] * bool(short)
    nll, count = 0.0, 0
    for group in groups:
        rows_BT = torch.stack([tokens[s:e] for s, e in group])
        logits_BTV = model(rows_BT).logits
        nll += F.cross_entropy(
            logits_BTV[:, :-1].flatten(0, 1).double(), rows_BT[:, 1:].flatten(), reduction="sum"
        ).item()
        count += rows_BT[:, 1:].numel()
    return nll, count


@dataclass
class Perplexity:
    nll: float  # summed negative log-likelihood, nats
    tokens: int  # tokens predicted
    files: int
    not_utf8: int
    empty: int
    seq_len: int
    model: Path  # the folder the weights were read from

    @property
    def nats_per_token(self) -> float:
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)

    def as_dict(self) -> dict:
        return {
            "perplexity": self.perplexity,
            "nats_per_token": self.nats_per_token,
            "tokens": self.tokens,
            "files": self.files,
            "skipped_not_utf8": self.not_utf8,
            "skipped_empty": self.empty,
            "seq_len": self.seq_len,
            "model": str(self.model),
        }


def evaluate(
    model: str | Path,
    data: str | Path,
    seq_len: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    text_only: bool = False,
) -> Perplexity:
    """Perplexity of a model folder, run folder or step folder (read through k3.hub) on the text at `data`.

    seq_len: tokens predicted per window (default min(512, max_position_embeddings - 1)).
    """
    from k3.hub import load_pretrained, load_tokenizer

    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size}: must be at least 1")
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"--seq-len {seq_len}: must be at least 1")
    found = read_texts(data)  # before the weights: a wrong --data path costs nothing
    pretrained = load_pretrained(model, device=device, text_only=text_only)
    limit = pretrained.config.max_position_embeddings
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, limit - 1)
    if not 1 <= seq_len <= limit - 1:
        raise ValueError(
            f"--seq-len {seq_len}: a window reads seq_len + 1 tokens, so 1 .. {limit - 1} for this "
            f"model (max_position_embeddings {limit:,})"
        )
    ids = token_stream(found.texts, load_tokenizer(pretrained))
    nll, count = score_tokens(pretrained.model, ids, seq_len, batch_size)
    return Perplexity(nll, count, len(found.texts), len(found.not_utf8), len(found.empty), seq_len, pretrained.path)
