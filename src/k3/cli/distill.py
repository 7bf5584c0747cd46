"""`k3 distill`: merge specialist teachers into one student by on-policy distillation (k3.distill)."""

import argparse
import dataclasses
import json
import shlex
import sys

from k3.cli.common import RUN_ERRORS, _interrupted, _run_error

CHOICES = {"objective": ["reverse-kl", "sft"], "schedule": ["cosine", "wsd"]}


def add_distill_parser(sub) -> None:
    """One flag per DistillArgs field, its help from the field's metadata (`--teacher` repeatable)."""
    from k3.distill.distiller import DistillArgs

    p = sub.add_parser("distill", help="merge specialist teachers into one student (on-policy reverse KL)")
    for f in dataclasses.fields(DistillArgs):
        flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"].replace("%", "%%")
        if f.name == "progress":
            p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
        elif f.name == "teacher":
            p.add_argument(flag, action="append", metavar="NAME=CKPT", default=None, help=text)
        elif f.type is bool:
            p.add_argument(flag, action="store_true", help=f"{text} (default: off)")
        elif f.default is dataclasses.MISSING:
            p.add_argument(flag, required=True, help=f"{text} (required)")
        else:
            kind = f.type if f.type in (int, float) else str
            shown = " (default: %(default)s)" if f.default is not None else ""
            p.add_argument(flag, type=kind, default=f.default, help=text + shown, choices=CHOICES.get(f.name))
    p.set_defaults(func=cmd_distill)


def _rerun(argv: list[str], resume: bool) -> str:
    argv = [a for a in argv if a != "--resume"] + (["--resume"] if resume else [])
    return " ".join(["k3", *map(shlex.quote, argv)])


def cmd_distill(args: argparse.Namespace) -> int:
    from k3.distill.distiller import DistillArgs, Distiller

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistillArgs)}
    distiller = None
    try:
        distiller = Distiller(DistillArgs(**values))
        n = sum(p.numel() for p in distiller.model.parameters())
        print(f"k3 distill: student {args.student} ({n / 1e6:.1f}M parameters), {len(distiller.teachers)} teachers, "
              f"mixture {distiller.mixture}, writing to {args.out}/", file=sys.stderr)  # fmt: skip
        summary = distiller.train()
    except KeyboardInterrupt:
        return _interrupted("distill", distiller, lambda resume: _rerun(sys.argv[1:], resume))
    except RUN_ERRORS as e:
        return _run_error("distill", e)
    print(json.dumps(summary))
    return 0
