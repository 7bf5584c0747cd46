"""A model measured on each domain: validation loss (nats per token) on the domain's held-out documents
(k3.train.corpus' split, the one `k3 train --data DOMAIN` holds out) and, for the reasoning domains, task
accuracy: the share of held-out tasks whose greedy continuation of the question gives the right answer
(k3.data.domains.check_answer), decoded by the serving engine.

The loss reads at most `max_tokens` tokens per domain, from held-out documents in a fixed shuffled order
(so a large domain is sampled across files, not read from its first one).
"""

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from k3.data.domains import REASONING_DOMAINS, check_answer, task_of
from k3.eval import score_tokens
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.train.corpus import load_corpus


@dataclass
class DomainScore:
    domain: str
    val_loss: float  # nats per token
    tokens: int  # tokens the loss averages over
    accuracy: float | None = None  # reasoning domains: share of tasks answered right
    tasks: int = 0


def held_out_tokens(domain: str, tokenizer, max_tokens: int) -> list[int]:
    """Up to max_tokens tokens of the domain's validation documents, each followed by end-of-text."""
    docs = load_corpus(domain)[1]
    random.Random(f"k3-eval-{domain}").shuffle(docs)
    ids: list[int] = []
    for doc in docs:
        ids += [*tokenizer.encode(doc.text), tokenizer.eos_id]
        if len(ids) >= max_tokens:
            break
    return ids[:max_tokens]


ANSWER_TOKENS = {"low": 12, "high": 56}  # room for the worked text (up to 4 steps) and the answer line


def task_accuracy(model: torch.nn.Module, tokenizer, domain: str, tasks: int) -> float:
    """Greedy answers to the first `tasks` held-out tasks of a reasoning domain, checked; the share right."""
    effort = domain.split("-", 1)[1]
    max_new_tokens = ANSWER_TOKENS[effort]
    chosen = [task_of(d.name) for d in load_corpus(domain)[1][:tasks]]
    engine = LLMEngine(model, tokenizer, EngineConfig(memory_budget=64 << 20, enable_prefix_caching=False))
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    ids = {engine.add_request(t.prompt(effort), greedy): t for t in chosen}
    text = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            text[out.request_id].append(out.new_text)
    return sum(check_answer(t, "".join(text[i])) for i, t in ids.items()) / len(chosen)


def evaluate_domains(
    path: str | Path,
    domains: list[str],
    max_tokens: int = 4096,
    tasks: int = 32,
    seq_len: int = 256,
    batch_size: int = 4,
) -> list[DomainScore]:
    """Each domain's validation loss and (reasoning domains) task accuracy of the model at `path`."""
    from k3.hub import load_pretrained, load_tokenizer

    pretrained = load_pretrained(path)
    tokenizer = load_tokenizer(pretrained)
    scores = []
    for domain in domains:
        nll, count = score_tokens(pretrained.model, held_out_tokens(domain, tokenizer, max_tokens), seq_len, batch_size)
        score = DomainScore(domain, nll / count, count)
        if domain in REASONING_DOMAINS:
            score.accuracy, score.tasks = task_accuracy(pretrained.model, tokenizer, domain, tasks), tasks
        scores.append(score)
    return scores
