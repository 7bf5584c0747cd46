"""`k3 distill`: merge specialist teachers into one student by on-policy distillation (k3.distill)."""

import argparse
import json
import shlex
import sys

from k3.cli.common import RUN_ERRORS, _interrupted, _run_error
from k3.formats.run_args import add_flags, command_line


def add_distill_parser(sub) -> None:
    """One flag per DistillArgs field (k3.formats.run_args.add_flags; `--teacher` repeatable)."""
    from k3.distill.distiller import DistillArgs

    p = sub.add_parser("distill", help="merge specialist teachers into one student (on-policy reverse KL)")
    add_flags(p, DistillArgs)
    p.set_defaults(func=cmd_distill)


def cmd_distill(args: argparse.Namespace) -> int:
    from k3.distill.distiller import DistillArgs, Distiller

    distiller = distill_args = None
    try:
        distill_args = DistillArgs.from_flags(args)
        distiller = Distiller(distill_args)
        n = sum(p.numel() for p in distiller.model.parameters())
        print(
            f"k3 distill: student {args.student} ({n / 1e6:.1f}M parameters), {len(distiller.teachers)} teachers, "
            f"mixture {distiller.mixture}, writing to {args.out}/",
            file=sys.stderr,
        )
        summary = distiller.train()
    except KeyboardInterrupt:

        def rerun(resume: bool) -> str:
            flags = command_line(distill_args, resume=resume, override=False)
            return " ".join(["k3", "distill", *map(shlex.quote, flags)])

        return _interrupted("distill", distiller, rerun)
    except RUN_ERRORS as e:
        return _run_error("distill", e)
    print(json.dumps(summary))
    return 0
