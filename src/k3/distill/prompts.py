"""The prompts the student continues, drawn per domain from the domain's training documents.

A corpus domain's prompt is a window of `prompt_tokens` tokens at a random place in a random document, and
its reference (what SFT trains on) the tokens that follow it in the document. A reasoning domain's prompt
is a task's question line, its reference the worked answer and the end-of-text token. Draws take a
random.Random, so a step's prompts are a function of (seed, step, row) and a resumed run draws the same.
"""

import random
from dataclasses import dataclass

from k3.data.domains import REASONING_DOMAINS, task_of
from k3.train.corpus import Document

MAX_DRAWS = 100  # documents tried for one long enough to hold a prompt and one more token


@dataclass(frozen=True)
class Prompt:
    domain: str
    ids: list[int]
    reference: list[int]  # the document's own continuation (at least one token)
    name: str  # the document it came from


class DomainPrompts:
    def __init__(self, domain: str, docs: list[Document], tokenizer, prompt_tokens: int, max_new_tokens: int):
        if not docs:
            raise ValueError(f"the {domain} domain has no training documents to draw prompts from")
        self.domain, self.docs, self.tokenizer = domain, docs, tokenizer
        self.prompt_tokens, self.max_new_tokens = prompt_tokens, max_new_tokens
        self._ids: dict[int, list[int]] = {}  # document index -> its tokens, encoded when first drawn

    def _tokens(self, index: int) -> list[int]:
        if index not in self._ids:
            self._ids[index] = self.tokenizer.encode(self.docs[index].text)
        return self._ids[index]

    def draw(self, rng: random.Random) -> Prompt:
        if self.domain in REASONING_DOMAINS:
            doc = self.docs[rng.randrange(len(self.docs))]
            effort = self.domain.split("-", 1)[1]
            task = task_of(doc.name)
            worked = [*self.tokenizer.encode(task.worked(effort)), self.tokenizer.eos_id]
            return Prompt(
                self.domain, self.tokenizer.encode(task.prompt(effort)), worked[: self.max_new_tokens], doc.name
            )
        for _ in range(MAX_DRAWS):
            index = rng.randrange(len(self.docs))
            ids = self._tokens(index)
            if len(ids) > self.prompt_tokens:
                start = rng.randrange(len(ids) - self.prompt_tokens)
                cut = start + self.prompt_tokens
                return Prompt(self.domain, ids[start:cut], ids[cut : cut + self.max_new_tokens], self.docs[index].name)
        raise ValueError(
            f"the {self.domain} domain: no document of {MAX_DRAWS} drawn is longer than "
            f"--prompt-tokens {self.prompt_tokens}; lower it"
        )
