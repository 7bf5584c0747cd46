"""The training text: by default the Python standard library's own source, present on every machine
with Python, so the quickstart needs no download; or any directory of text files, or one file."""

import hashlib
import sysconfig
from collections.abc import Callable
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


def _digest(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def _is_val(name: str, val_fraction: float) -> bool:
    """A deterministic split by file: the same name lands on the same side on every machine."""
    return _digest(name) % 10_000 < val_fraction * 10_000


def _read(path: Path) -> str | None:
    """The file's UTF-8 text ("" for an empty file), or None for a file that is not UTF-8 text (a few
    stdlib test files are deliberately not; a NUL byte marks a binary file)."""
    try:
        data = path.read_bytes()
        return None if b"\0" in data else data.decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _split_lines(doc: Document, val_fraction: float) -> tuple[Document, Document]:
    lines = doc.text.splitlines(keepends=True)
    if len(lines) < 2:
        raise CorpusError(f"{doc.name}: one line of text cannot be split into training and validation parts")
    cut = min(len(lines) - 1, max(1, int(len(lines) * (1 - val_fraction))))
    return Document(doc.name, "".join(lines[:cut])), Document(doc.name + ":val", "".join(lines[cut:]))


def _read_folder(root: Path, paths: list[Path], what: str, log: Callable[[str], None] | None) -> list[Document]:
    """The UTF-8 text files among `paths`, in name order; the others are counted and reported."""
    docs, not_text, empty = [], [], []
    for path in sorted(paths):
        text = _read(path)
        name = path.relative_to(root).as_posix()
        if text is None:
            not_text.append(name)
        elif not text:
            empty.append(name)
        else:
            docs.append(Document(name, text))
    if log is not None and (not_text or empty):
        parts = []
        if not_text:
            parts.append(f"{len(not_text)} not UTF-8 text (e.g. {', '.join(not_text[:3])})")
        if empty:
            parts.append(f"{len(empty)} empty (e.g. {', '.join(empty[:3])})")
        log(f"{what} {root}: skipped {' and '.join(parts)}; using {len(docs)} files")
    return docs


def domain_spec(data: str | Path | None) -> str | None:
    """`data` when it names a domain (k3.data.domains: code, tests, docs, reasoning-low, reasoning-high, or
    several joined with '+'), otherwise None. A bare domain name is the domain even where a folder of that
    name exists (the repository's tests/): `./tests` names the folder."""
    from k3.data.domains import is_domain_spec

    return str(data) if isinstance(data, str) and is_domain_spec(data) else None


def data_entry(path: str | None, sha256: str | None) -> dict[str, str | None]:
    """The data as a run folder records it (k3.formats.run_record): an absolute path (None: the standard
    library; a domain: its name, not a path) and its content's sha256."""
    where = None if path is None else domain_spec(path) or str(Path(path).resolve())
    return {"path": where, "sha256": sha256}


def _documents(data: str | Path | None, what: str, log: Callable[[str], None] | None) -> tuple[list[Document], bool]:
    """(documents, whether `data` is a single file)."""
    if data is not None and domain_spec(data) is not None:  # a domain of the standard library, or tasks
        from k3.data.domains import domain_documents

        base = [] if all(d.startswith("reasoning-") for d in str(data).split("+")) else _documents(None, what, log)[0]
        return [Document(n, t) for n, t in domain_documents(str(data), [(d.name, d.text) for d in base])], False
    if data is None:
        root = stdlib_root()
        paths = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts]
        return _read_folder(root, paths, "the standard library", log), False
    root = Path(data)
    if not root.exists():
        raise CorpusError(f"{what} {root}: no such file or directory")
    if root.is_file():
        text = _read(root)
        if text is None:
            raise CorpusError(f"{what} {root}: not a UTF-8 text file")
        if not text:
            raise CorpusError(f"{what} {root}: the file is empty")
        return [Document(root.name, text)], True
    docs = _read_folder(root, [p for p in root.rglob("*") if p.is_file()], what, log)
    if not docs:
        raise CorpusError(f"{what} {root}: no UTF-8 text files in it")
    return docs, False


def load_corpus(
    data: str | Path | None = None,
    val_fraction: float = 0.02,
    val_data: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[list[Document], list[Document]]:
    """(train, validation) documents, in a deterministic order.

    data None: every .py file of the standard library, site-packages excluded. A domain name
    (`domain_spec`): that domain's documents, named after the files or tasks they came from. A directory: every
    UTF-8 text file below it (the others, and empty files, are skipped and reported through `log`).
    A single file: its text split at a line boundary.

    Validation is `val_data` (a file or directory, all of it) when given; otherwise a fraction of
    `data`: the files whose name hashes below val_fraction, the same on every machine. When that leaves
    either side empty (a folder of a few files), the files are ranked by the same hash and the lowest
    round(val_fraction · n) of them, at least one and at most n − 1, are validation; one file is split
    at a line boundary.
    """
    if not 0 < val_fraction < 1:
        raise CorpusError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    docs, single = _documents(data, "--data", log)
    if val_data is not None:
        val, _ = _documents(val_data, "--val-data", log)
        return docs, val
    if single or len(docs) == 1:
        train, val = _split_lines(docs[0], val_fraction)
        return [train], [val]
    train = [d for d in docs if not _is_val(d.name, val_fraction)]
    val = [d for d in docs if _is_val(d.name, val_fraction)]
    if not train or not val:
        ranked = sorted(docs, key=lambda d: _digest(d.name))
        k = min(len(docs) - 1, max(1, round(len(docs) * val_fraction)))
        chosen = {d.name for d in ranked[:k]}
        train = [d for d in docs if d.name not in chosen]
        val = [d for d in docs if d.name in chosen]
    return train, val


def fingerprint(docs: list[Document]) -> str:
    """sha256 over the documents' names and texts: what a run folder records of the data it was made from."""
    h = hashlib.sha256()
    for d in docs:
        for part in (d.name, d.text):
            data = part.encode("utf-8", errors="surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.hexdigest()
