"""Accuracy or loss by context length (`k3 eval --task retrieval|multihop|count|mqar|lm --lengths 512,2048,...`).

Tasks (k3.data.synthetic, held-out split): an example of L tokens ends with its answer; it counts as
solved when the model's greedy choice (argmax of the logits) is the right token at every answer
position, given the true tokens before it, which is what greedy decoding of the answer would produce.
mqar has one answer per query: each is scored the same way (teacher-forced: the context holds the
earlier queries with their true answers), and accuracy is the fraction of all queries answered.
`lm`: nats per token over windows of L + 1 tokens of text (each predicts its last L tokens), and the
same over the window's last quarter, where the context is longest.

Long contexts run through the model's decoding cache in chunks of `chunk_tokens` (KDA carries its
fixed-size state, MLA its latents: T × kv_lora_rank per MLA layer), so memory holds the latents and one
chunk's attention scores, not a T × T matrix; only the positions that are scored get logits. The result
equals one uncached forward (tests/test_eval_lengths.py checks it in float64).
"""

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from k3.data.synthetic import TASKS, eval_set
from k3.model.cache import K3Cache

EVAL_TASKS = (*TASKS, "lm")
DEFAULT_CHUNK_TOKENS = 1024


@dataclass
class LengthResult:
    task: str
    length: int
    examples: int  # examples (or lm windows) scored
    accuracy: float | None  # tasks: the fraction solved (mqar: of the queries of all examples)
    nats_per_token: float | None  # lm: over every predicted token of a window
    late_nats_per_token: float | None  # lm: over each window's last quarter
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def chunked_logits(model, ids_BT: torch.Tensor, positions: list[int], chunk_tokens: int) -> torch.Tensor:
    """(B, len(positions), vocab) logits at `positions` (sorted, 0-based) of ids (B, T), computed by feeding
    the tokens through a fresh K3Cache `chunk_tokens` at a time."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    cache = K3Cache.empty(model.config)
    wanted = torch.tensor(positions, dtype=torch.long)
    T, out = ids_BT.shape[1], []
    for start in range(0, T, chunk_tokens):
        end = min(T, start + chunk_tokens)
        inside = wanted[(wanted >= start) & (wanted < end)] - start
        # a chunk with nothing scored still needs one logit position: the forward fills the cache regardless
        at = inside if len(inside) else torch.tensor([end - start - 1])
        logits = model(ids_BT[:, start:end], cache=cache, logits_at=at.to(ids_BT.device)).logits
        if len(inside):
            out.append(logits)
    return torch.cat(out, dim=1)


def task_accuracy(
    model,
    tokenizer,
    task: str,
    length: int,
    examples: int,
    batch_size: int = 4,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    pairs: int | None = None,
) -> LengthResult:
    """The fraction of the answers in the held-out examples 0 .. examples-1 of `task` at `length` the model
    gets right: one per example, or (mqar) one per query; pairs: mqar's bindings (default: as many as fit)."""
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    exs = eval_set(task, length, examples, tokenizer, **({} if pairs is None else {"pairs": pairs}))
    solved = answers = 0
    for i in range(0, len(exs), batch_size):
        group = exs[i : i + batch_size]
        ids = torch.tensor([ex.tokens for ex in group], device=device)
        # examples of one length may differ in where answers start (count: " 3" vs " 12"); score each span
        first = min(ex.answer_start for ex in group)
        logits = chunked_logits(model, ids, list(range(first - 1, length - 1)), chunk_tokens)
        guess = logits.argmax(-1)  # (B, positions): guess[:, j] is the guess for token first + j
        for row, ex in enumerate(group):
            for start, end in ex.spans:
                solved += bool((guess[row, start - first : end - first] == ids[row, start:end]).all())
                answers += 1
    return LengthResult(task, length, len(exs), solved / answers, None, None, time.perf_counter() - t0)


def lm_loss(
    model, tokens: np.ndarray, length: int, windows: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, batch_size: int = 1
) -> LengthResult:
    """Nats per token over `windows` windows of length + 1 tokens spread evenly over the token stream."""
    if len(tokens) < length + 1:
        raise ValueError(
            f"--task lm at length {length:,}: the text has only {len(tokens):,} tokens; give more "
            f"text (--data) or shorter --lengths"
        )
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    count = max(1, min(windows, len(tokens) // (length + 1)))
    starts = np.linspace(0, len(tokens) - length - 1, count).astype(np.int64)
    late = length - length // 4
    nll = late_nll = 0.0
    for i in range(0, count, batch_size):
        ids = torch.tensor(
            np.stack([tokens[s : s + length + 1] for s in starts[i : i + batch_size]]), dtype=torch.long, device=device
        )
        logits = chunked_logits(model, ids, list(range(length)), chunk_tokens)
        per_token = F.cross_entropy(logits.flatten(0, 1).double(), ids[:, 1:].flatten(), reduction="none")
        per_token = per_token.view(ids.shape[0], length)
        nll += per_token.sum().item()
        late_nll += per_token[:, late:].sum().item()
    return LengthResult(
        "lm",
        length,
        count,
        None,
        nll / (count * length),
        late_nll / (count * (length - late)),
        time.perf_counter() - t0,
    )


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--lengths {text!r}: a comma-separated list of token counts, e.g. 512,2048,8192") from None
    if not lengths or min(lengths) < 2:
        raise ValueError(f"--lengths {text!r}: every length must be at least 2 tokens")
    return lengths


def check_pairs(task: str | None, pairs: int | None) -> None:
    """A readable error for --pairs where it means nothing: it sets mqar's bindings per example only."""
    if pairs is not None and task != "mqar":
        raise ValueError(
            f"--pairs sets the bindings per example of --task mqar; it does nothing for "
            f"{'--task ' + task if task else 'perplexity'}: drop it or use --task mqar"
        )
    if pairs is not None and pairs < 1:
        raise ValueError(f"--pairs must be at least 1, got {pairs}")


def lm_tokens(data: str | Path | None, pretrained, tokenizer) -> np.ndarray:
    """The text `lm` is scored on: --data (files, tokenised as training packs them), or else the validation
    tokens of the run the checkpoint belongs to."""
    from k3.eval import read_texts, token_stream

    if data is not None:
        return np.asarray(token_stream(read_texts(data).texts, tokenizer), dtype=np.int64)
    for folder in (pretrained.path, pretrained.path.parent):
        if (folder / "val_tokens.npy").exists():
            return np.load(folder / "val_tokens.npy").astype(np.int64)
    raise ValueError(f"--task lm needs --data: {pretrained.path} is not in a run folder with val_tokens.npy")


def evaluate_lengths(
    model: str | Path,
    task: str,
    lengths: list[int],
    examples: int = 20,
    batch_size: int = 4,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    data: str | Path | None = None,
    device: str = "cpu",
    text_only: bool = False,
    pairs: int | None = None,
    log=None,
) -> list[LengthResult]:
    """`task` at each of `lengths` for a model, run or step folder; `log(result)` after each length.
    pairs: mqar's bindings per example (default: as many as fit each length)."""
    from k3.hub import load_pretrained, load_tokenizer

    if task not in EVAL_TASKS:
        raise ValueError(f"--task {task!r}: choose one of {', '.join(EVAL_TASKS)}")
    check_pairs(task, pairs)
    if examples < 1 or batch_size < 1 or chunk_tokens < 1:
        raise ValueError(
            f"--examples, --batch-size and --chunk-tokens must be at least 1, got {examples}, "
            f"{batch_size} and {chunk_tokens}"
        )
    pretrained = load_pretrained(model, device=device, text_only=text_only)
    limit = pretrained.config.max_position_embeddings
    too_long = [n for n in lengths if n + (task == "lm") > limit]
    if too_long:
        raise ValueError(
            f"--lengths {','.join(map(str, too_long))}: longer than this model's context of "
            f"{limit:,} tokens (max_position_embeddings)"
        )
    tokenizer = load_tokenizer(pretrained)
    stream = lm_tokens(data, pretrained, tokenizer) if task == "lm" else None
    results = []
    for length in lengths:
        if task == "lm":
            result = lm_loss(pretrained.model, stream, length, examples, chunk_tokens, batch_size)
        else:
            result = task_accuracy(
                pretrained.model, tokenizer, task, length, examples, batch_size, chunk_tokens, pairs=pairs
            )
        results.append(result)
        if log is not None:
            log(result)
    return results


def describe(result: LengthResult) -> str:
    """One table row: length, the score, examples, time."""
    if result.accuracy is not None:
        score = f"accuracy {result.accuracy:6.1%}"
    else:
        score = (
            f"{result.nats_per_token:.4f} nats/token (last quarter {result.late_nats_per_token:.4f}, "
            f"perplexity {math.exp(result.nats_per_token):.2f})"
        )
    return f"{result.task:9s} {result.length:>8,} tokens  {score}  n={result.examples}  {result.seconds:.1f} s"
