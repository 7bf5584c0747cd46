"""Writing a run folder so that a kill at any moment leaves either the old file or the new one.

Every whole file (tokenizer.json, run.json, the packed tokens, plots) goes through `atomic_write`: the
bytes are written to a hidden temporary file beside the target, fsynced, renamed over the target, and the
folder is fsynced so the rename itself survives a power cut. metrics.jsonl is the one file that grows: it
is only ever appended to, one fsynced line per step, and `read_jsonl` drops a torn last line (the line a
kill interrupted) and says so. Temporary names start with "." and end in ".tmp", so `clean_stale_temp`
can remove what a killed write left behind.
"""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path


class RunFileError(ValueError):
    """A run-folder file that cannot be read as what it should be."""


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list holds the renames made in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def atomic_write(path: str | Path, data: bytes | str | Callable[[Path], None]) -> Path:
    """Write `data` (bytes, text as UTF-8, or a function that writes the file it is given) to `path`
    through a temporary file, fsync and rename. Returns `path`."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        if callable(data):
            data(tmp)
        else:
            tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def append_line(path: str | Path, line: str) -> None:
    """Append one line and fsync it: a kill loses at most this line, never an earlier one."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def repair_torn_tail(path: str | Path) -> int:
    """Cut an unfinished last line (no newline: a kill mid-append) off `path`, so the next append starts
    on a line of its own. Returns the number of bytes removed."""
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    os.truncate(path, keep)
    return len(data) - keep


def read_jsonl(path: str | Path, log: Callable[[str], None] | None = None) -> list[dict]:
    """The JSON objects of a .jsonl file, one per line. A torn last line (a kill mid-append) is dropped
    and reported through `log`; a bad line anywhere else is an error naming the file and line."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # the last line has no newline after it: an append was interrupted
                if log is not None:
                    log(
                        f"{path}: dropped a torn last line (line {number}, {len(line)} bytes) left by an "
                        f"interrupted write"
                    )
                continue
            raise RunFileError(f"{path}, line {number}: not a JSON object ({e}); the file is damaged") from e
        if not isinstance(record, dict):
            raise RunFileError(f"{path}, line {number}: a JSON {type(record).__name__}, not an object")
        records.append(record)
    return records


def latest_timeline(records: list[dict]) -> list[dict]:
    """A metrics log as the run finally went: when a resumed (or restarted) run logs a step at or before
    one already logged, what was logged from that step on is replaced by what follows."""
    kept: list[dict] = []
    for record in records:
        step = record.get("step", 0)
        while kept and kept[-1].get("step", 0) >= step:
            kept.pop()
        kept.append(record)
    return kept


def clean_stale_temp(folder: Path) -> list[str]:
    """Remove the temporary files and `.step_N.tmp` folders that killed writes left in `folder`.
    Returns their names. Call it only when no other process writes to the folder."""
    removed = []
    for p in sorted(folder.glob(".*.tmp")):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed
