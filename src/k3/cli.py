"""The `k3` command line. Thin: each subcommand parses its flags and calls into the package."""

import argparse
import json
import os
import platform
import sys

import torch

import k3
from k3.config import PRESETS, ConfigError, K3Config
from k3.model.params import DEFAULT_CONTEXT, format_report, param_report


def cmd_env(args: argparse.Namespace) -> int:
    """What k3 will run on here: versions, threads, devices, and which KDA backend each device gets."""
    from k3.ops.kda.backend import ENV_VAR, fla_kda, resolve

    cpu = torch.zeros(0)
    rows = [
        ("k3", k3.__version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("cpu threads", str(torch.get_num_threads())),
        ("cuda", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not available"),
        ("fla kernels", "importable" if fla_kda() is not None else "not importable (torch path only)"),
        (ENV_VAR, os.environ.get(ENV_VAR, "unset (auto)")),
        ("KDA backend on cpu", resolve(None, cpu)),
    ]
    if torch.cuda.is_available():
        rows.append(("KDA backend on cuda", resolve(None, cpu.cuda())))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _context(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens (an integer >= 0)")
    return int(text)


def cmd_params(args: argparse.Namespace) -> int:
    """Parameters by component (total and active), FLOPs per token, MLA cache and KDA state sizes."""
    try:
        if args.config is None:
            config, source = K3Config.from_preset(args.preset or "k3"), f"preset {args.preset or 'k3'}"
        else:
            config, source = K3Config.from_hf(args.config), args.config
    except ConfigError as e:
        print(f"k3 params: {e}", file=sys.stderr)
        return 2
    report = param_report(config, context=args.context)
    print(json.dumps(report, indent=2) if args.json else format_report(report, source))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3: read, train, serve and measure it.")
    parser.add_argument("--version", action="version", version=f"k3 {k3.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="show versions, devices and the KDA backend each device uses")
    env.set_defaults(func=cmd_env)
    params = sub.add_parser("params", help="count parameters by component; FLOPs, cache and state sizes")
    which = params.add_mutually_exclusive_group()
    which.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration (default: k3)")
    which.add_argument("--config", help="an official config.json, or the folder holding it")
    params.add_argument(
        "--context",
        type=_context,
        default=DEFAULT_CONTEXT,
        help=f"tokens each token attends to in MLA, for FLOPs (default {DEFAULT_CONTEXT})",
    )
    params.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    params.set_defaults(func=cmd_params)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
