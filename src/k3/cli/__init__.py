"""The `k3` command line. Thin: each subcommand parses its flags and calls into the package.

One module per group of commands: info (env, params), training (train, init, quickstart), generation
(generate, eval), tools (serve, export, plot, demo); the parser and `main` in parser.py.
"""

from k3.cli.common import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED
from k3.cli.parser import build_parser, main
from k3.cli.training import _train_args, next_generate

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "_train_args", "build_parser", "main", "next_generate"]
