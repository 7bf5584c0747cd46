"""The training text: by default the Python standard library's own source, present on every machine
with Python, so the quickstart needs no download; or any directory of text files, or one file."""

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path


class CorpusError(ValueError):
    """The corpus location holds nothing k3 can train on."""


@dataclass(frozen=True)
class Document:
    name: str  # path relative to the corpus root, stable across machines
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_val(name: str, val_percent: float) -> bool:
    """A deterministic split by file: the same name lands on the same side on every machine."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return digest % 10_000 < val_percent * 100


def _read(path: Path) -> str | None:
    """UTF-8 text, or None for a file that is not (a few stdlib test files are deliberately not)."""
    try:
        data = path.read_bytes()
        return None if b"\0" in data else data.decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def load_corpus(data: str | Path | None = None, val_percent: float = 2.0) -> tuple[list[Document], list[Document]]:
    """(train, validation) documents, in a deterministic order.

    data None: every .py file of the standard library, site-packages excluded. A directory: every
    UTF-8 text file below it. A single file: its text split 98/2 at a line boundary.
    """
    if data is None:
        root = stdlib_root()
        paths = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts]
    else:
        root = Path(data)
        if not root.exists():
            raise CorpusError(f"--data {root}: no such file or directory")
        if root.is_file():
            text = _read(root)
            if not text:
                raise CorpusError(f"--data {root}: not a UTF-8 text file")
            lines = text.splitlines(keepends=True)
            cut = max(1, int(len(lines) * (1 - val_percent / 100)))
            return [Document(root.name, "".join(lines[:cut]))], [Document(root.name + ":val", "".join(lines[cut:]))]
        paths = [p for p in root.rglob("*") if p.is_file()]
    train, val = [], []
    for path in sorted(paths):
        text = _read(path)
        if not text:
            continue
        name = path.relative_to(root).as_posix()
        (val if _is_val(name, val_percent) else train).append(Document(name, text))
    if not train or not val:
        raise CorpusError(f"{root}: found {len(train)} training and {len(val)} validation text files; need both")
    return train, val
