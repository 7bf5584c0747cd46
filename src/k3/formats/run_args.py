"""The arguments every training loop starts from, and the command line made from a dataclass of them.

`RunArgs` holds what all four loops (k3 train, the image-text trainer, k3 distill, k3 train-draft) share: the
run folder, how long, the seed, and how a folder is reused (`--resume`, `--override`, checkpoint cadence and
how many are kept). Each loop's arguments are a subclass; each field is declared once, with `arg`, and its
metadata is what the command line shows and checks:

    help      the flag's help line (the default is appended by `add_flags`)
    recorded  whether run.json records it, so that reusing the folder with another value is refused unless
              --override (k3.formats.run_record); flags that only change what is shown or kept are not
    model     whether it chooses the model, so that it cannot change once a checkpoint exists, --override or not
    path      a path, recorded absolute
    choices   the values it may take: argparse offers them and __post_init__ refuses any other
    aliases   other spellings of the flag (`--model` for `--ckpt`)

`add_flags` makes one argparse flag per field (the CLI never re-types a default or a choice) and
`command_line` turns a filled dataclass back into the flags that differ from the defaults, for the
"resume with: ..." line a run prints.
"""

import argparse
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any


def arg(
    default: Any = MISSING,
    help: str = "",
    *,
    recorded: bool = True,
    model: bool = False,
    path: bool = False,
    choices: tuple | list | None = None,
    metavar: str | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A field of a RunArgs dataclass (module docstring). A bool that is on by default becomes a --no-NAME
    flag: its help describes that flag."""
    metadata = dict(help=help, recorded=recorded, model=model, path=path, choices=choices, metavar=metavar)
    metadata["aliases"] = aliases
    return field(default=default, metadata=metadata)


def flag(name: str, negated: bool = False) -> str:
    """The command-line spelling of a field: keep_last -> --keep-last (negated: progress -> --no-progress)."""
    return ("--no-" if negated else "--") + name.replace("_", "-")


KEEP_LAST = "checkpoints kept (the newest, with optimiser state, is what --resume needs; 0 keeps all)"


@dataclass(kw_only=True)
class RunArgs:
    """What every training loop takes: its run folder and how the folder is reused (module docstring).
    Subclasses redeclare a field to change its default or help; it keeps its place."""

    out: str = arg(help="the run folder: run.json, tokenizer.json, metrics.jsonl, step_*/ checkpoints", recorded=False)
    steps: int = arg(help="optimiser steps in all (with --resume: raise it to continue a finished run)", recorded=False)
    seed: int = arg(0, "seed of the initialisation and of the data order")
    resume: bool = arg(False, "continue from the run folder's newest checkpoint", recorded=False)
    override: bool = arg(False, "accept data or flags that differ from what the run folder recorded", recorded=False)
    ckpt_every: int = arg(100, "steps between checkpoints (the last step is always saved)", recorded=False)
    keep_last: int = arg(1, KEEP_LAST, recorded=False)
    progress: bool = arg(True, "no progress bar (default: a progress bar on stderr)", recorded=False)

    def __post_init__(self) -> None:
        self.at_least(1, "steps", "ckpt_every")
        self.at_least(0, "keep_last")
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices is not None and value not in choices:
                raise ValueError(f"{flag(f.name)} must be one of {', '.join(map(str, choices))}, got {value!r}")

    def at_least(self, minimum: float, *names: str) -> None:
        for name in names:
            if getattr(self, name) < minimum:
                raise ValueError(f"{flag(name)} must be at least {minimum}, got {getattr(self, name)}")

    def recorded(self) -> dict[str, Any]:
        """The flags run.json records (metadata recorded), paths made absolute."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("recorded", True):
                as_path = f.metadata.get("path") and value is not None
                values[f.name] = str(Path(value).resolve()) if as_path else value
        return values

    def model_flags(self) -> list[str]:
        """The recorded flags that choose the model itself (metadata model)."""
        return [f.name for f in fields(self) if f.metadata.get("model")]

    @classmethod
    def from_flags(cls, namespace: argparse.Namespace, **changes: Any) -> "RunArgs":
        """The dataclass of a parsed command line (add_flags' dests are the field names), with `changes`."""
        values = {f.name: getattr(namespace, f.name) for f in fields(cls) if hasattr(namespace, f.name)}
        return cls(**{**values, **changes})


def _is_list(kind: Any) -> bool:
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    return any(typing.get_origin(o) is list for o in options)


def _scalar(kind: Any) -> type:
    """The argparse type of a field: int and float as they are, anything else (str, str | None) as str."""
    return kind if kind in (int, float) else str


def add_flags(parser: argparse.ArgumentParser, cls: type, **defaults: Any) -> None:
    """One flag per field of the dataclass `cls`, its help the field's with the default appended; `defaults`
    replace the dataclass's own (`k3 quickstart` trains fewer steps than `k3 train`)."""
    for f in fields(cls):
        default = defaults.get(f.name, f.default)
        names, text = (flag(f.name), *f.metadata["aliases"]), f.metadata["help"].replace("%", "%%")
        if f.type is bool and default is True:
            parser.add_argument(flag(f.name, negated=True), dest=f.name, action="store_false", help=text)
        elif f.type is bool:
            parser.add_argument(*names, action="store_true", default=default, help=f"{text} (default: off)")
        elif _is_list(f.type):
            parser.add_argument(*names, action="append", metavar=f.metadata["metavar"], help=text)
        elif default is MISSING:
            parser.add_argument(*names, dest=f.name, type=_scalar(f.type), required=True, help=f"{text} (required)")
        else:
            shown = " (default: %(default)s)" if default is not None else ""
            shown = shown or ("" if "default" in text else " (default: none)")
            kind, choices = _scalar(f.type), f.metadata["choices"]
            parser.add_argument(*names, dest=f.name, type=kind, default=default, choices=choices, help=text + shown)


def command_line(args: RunArgs, defaults: dict[str, Any] | None = None, **changes: Any) -> list[str]:
    """The flags that give `args` (with `changes` to its values) on a command line whose parser add_flags
    built with `defaults`: --out always, every other field only where it differs from its default."""
    defaults = defaults or {}
    parts = []
    for f in fields(args):
        value = changes.get(f.name, getattr(args, f.name))
        default: Any = defaults.get(f.name, f.default)
        if f.name != "out" and value == default:
            continue
        if f.type is bool:
            parts.append(flag(f.name, negated=not value))
        elif _is_list(f.type):
            for item in value or []:
                parts += [flag(f.name), str(item)]
        else:
            parts += [flag(f.name), str(value)]
    return parts
