"""The `k3` command line. Thin: each subcommand parses its flags and calls into the package."""

import argparse
import os
import platform
import sys

import torch

import k3


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3: read, train, serve and measure it.")
    parser.add_argument("--version", action="version", version=f"k3 {k3.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="show versions, devices and the KDA backend each device uses")
    env.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
