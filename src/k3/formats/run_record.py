"""run.json: what a run folder was made from, so reusing the folder cannot silently mix two runs.

A run folder caches work that depends on its inputs (tokenizer.json learned from the data, the packed
token streams, metrics.jsonl, checkpoints of a model trained with certain flags). run.json records those
inputs when the run starts: the training and validation data (path and a sha256 over every document's
name and text), the sha256 of tokenizer.json, and every flag that changes what the run computes (the
fields a RunArgs dataclass marks recorded; --steps is not one: raising it is how a finished run is
continued, and --out, --resume, --ckpt-every, --keep-last, --progress or --override only change what is
shown or kept). Any later run with `--out` the same folder (a resume, or a restart after an interruption
before the first checkpoint) is compared with it, and a difference is an error naming each flag, unless
`--override` is given: then the new values take effect and run.json records them, with the step they took
effect at (k3.formats.run_folder does this for every training loop).
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3.formats.files import atomic_write
from k3.formats.run_args import flag

RUN_FILE = "run.json"
FORMAT = "k3-run-1"


class RunMismatchError(ValueError):
    """The run folder was made from other data, tokenizer or flags than the ones given now."""


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass
class RunRecord:
    flags: dict[str, Any]
    data: dict[str, Any] | None  # {"path": str | None, "sha256": str | None}; None: the run reads no corpus
    val_data: dict[str, Any] | None
    tokenizer_sha256: str | None
    history: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "flags": self.flags,
            "data": self.data,
            "val_data": self.val_data,
            "tokenizer_sha256": self.tokenizer_sha256,
            "history": self.history,
        }


def read_record(run: Path) -> RunRecord | None:
    path = Path(run) / RUN_FILE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunMismatchError(f"{path} is not valid JSON ({e}); it records what the run was made from") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("flags"), dict):
        raise RunMismatchError(f"{path} is not a {FORMAT} record")
    return RunRecord(
        raw["flags"],
        raw.get("data") or {},
        raw.get("val_data"),
        raw.get("tokenizer_sha256"),
        list(raw.get("history", [])),
    )


def write_record(run: Path, record: RunRecord) -> None:
    atomic_write(Path(run) / RUN_FILE, json.dumps(record.to_json(), indent=1) + "\n")


def _data_diff(flag: str, recorded: dict[str, Any] | None, now: dict[str, Any] | None) -> list[str]:
    recorded, now = recorded or {"path": None, "sha256": None}, now or {"path": None, "sha256": None}
    where = {k: (v["path"] or "the standard library") for k, v in (("r", recorded), ("n", now))}
    if recorded["path"] != now["path"]:
        return [f"{flag}: the run was made from {where['r']}, now {where['n']}"]
    if recorded.get("sha256") and now.get("sha256") and recorded["sha256"] != now["sha256"]:
        return [
            f"{flag}: the files of {where['n']} changed since the run started (content sha256 "
            f"{recorded['sha256'][:12]}… then, {now['sha256'][:12]}… now)"
        ]
    return []


def differences(recorded: RunRecord, now: RunRecord) -> list[str]:
    """What `now` asks differently from what the run folder recorded, one readable item per flag."""
    diffs = _data_diff("--data", recorded.data, now.data)
    diffs += _data_diff("--val-data", recorded.val_data, now.val_data)
    for name, value in now.flags.items():
        if name in recorded.flags and recorded.flags[name] != value:
            diffs.append(f"{flag(name)}: the run recorded {recorded.flags[name]!r}, now {value!r}")
    if recorded.tokenizer_sha256 and now.tokenizer_sha256 and recorded.tokenizer_sha256 != now.tokenizer_sha256:
        diffs.append("tokenizer.json: it was replaced after the run started (its sha256 differs from run.json's)")
    return diffs


def model_differences(recorded: RunRecord, now: RunRecord, names: list[str]) -> list[str]:
    """The differences no --override can accept once a checkpoint exists: those of the flags `names`, which
    choose the model itself."""
    changed = [n for n in names if n in recorded.flags and recorded.flags[n] != now.flags.get(n)]
    return [
        f"{flag(n)}: the checkpoints hold a model made with {recorded.flags[n]!r}, not {now.flags.get(n)!r}"
        for n in changed
    ]
