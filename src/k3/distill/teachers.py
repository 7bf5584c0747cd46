"""Teachers: `--teacher NAME=CKPT`, where NAME is the domain the teacher owns, several joined with '+'
(`reasoning-low+reasoning-high=runs/t-math`), or `all` (one generalist for every domain). Each domain has
at most one teacher; a sample is scored by the teacher of its prompt's domain.

A teacher must read the student's tokens: the same tokenizer.json (byte for byte) and the same
vocabulary size. Anything else is a TeacherError naming the teacher and what differs.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from k3.data.domains import DOMAINS, DomainError, parse_domains


class TeacherError(ValueError):
    """A --teacher that cannot be parsed, loaded, or used with this student."""


@dataclass(frozen=True)
class TeacherSpec:
    domains: tuple[str, ...]
    path: str
    text: str  # as written on the command line, for messages

    @staticmethod
    def parse(text: str) -> "TeacherSpec":
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise TeacherError(
                f"--teacher {text!r}: write NAME=CKPT, NAME a domain ({', '.join(DOMAINS)}), "
                f"several joined with '+', or 'all'; CKPT a run, step or model folder"
            )
        try:
            domains = DOMAINS if name == "all" else parse_domains(name)
        except DomainError as e:
            raise TeacherError(f"--teacher {text!r}: {e}") from None
        return TeacherSpec(domains, path, text)


def route(specs: list[TeacherSpec]) -> dict[str, int]:
    """domain -> index of the teacher that owns it; a domain claimed twice is a TeacherError."""
    owner: dict[str, int] = {}
    for i, spec in enumerate(specs):
        for domain in spec.domains:
            if domain in owner:
                raise TeacherError(
                    f"the {domain} domain has two teachers: --teacher {specs[owner[domain]].text!r} "
                    f"and --teacher {spec.text!r}; give each domain one"
                )
            owner[domain] = i
    return owner


def load_teacher(spec: TeacherSpec, tokenizer_bytes: bytes, vocab_size: int, device: torch.device):
    """The teacher's model (eval mode, no gradients), checked against the student's tokenizer and vocabulary."""
    from k3.hub import load_pretrained

    if not Path(spec.path).exists():
        raise TeacherError(f"--teacher {spec.text}: {spec.path}: no such checkpoint, run or model folder")
    try:
        pretrained = load_pretrained(spec.path, device=device)
    except ValueError as e:
        raise TeacherError(f"--teacher {spec.text}: {e}") from None
    if pretrained.config.vocab_size != vocab_size:
        raise TeacherError(
            f"--teacher {spec.text}: vocabulary mismatch: the teacher's model has "
            f"{pretrained.config.vocab_size} tokens, the student's {vocab_size}; a teacher must "
            f"share the student's tokenizer"
        )
    if pretrained.tokenizer_path is None:
        raise TeacherError(
            f"--teacher {spec.text}: no tokenizer.json beside the weights, so k3 cannot check that "
            f"it reads the student's tokens"
        )
    if pretrained.tokenizer_path.read_bytes() != tokenizer_bytes:
        raise TeacherError(
            f"--teacher {spec.text}: vocabulary mismatch: its tokenizer.json differs from the "
            f"student's (token ids would mean other text); fine-tune teachers from the student's "
            f"run (k3 train --init-from)"
        )
    model = pretrained.model.eval()
    model.requires_grad_(False)
    return model
