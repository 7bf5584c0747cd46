"""What every k3 command shares: exit codes, the errors reported as one line, small argument checks."""

import argparse
import sys

import torch


def _context(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens (an integer >= 0)")
    return int(text)


USER_ERRORS = (ValueError, FileNotFoundError)  # ConfigError, CheckpointError, CorpusError are ValueErrors


def _fail(command: str, error: Exception) -> int:
    print(f"k3 {command}: {error}", file=sys.stderr)
    return 2


RUN_ERRORS = (ValueError, OSError)  # user mistakes about a run: bad values, paths, a read-only folder


def _run_error(command: str, error: Exception) -> int:
    """One line for a user mistake; an OSError names its file rather than its errno."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        error = f"{error.filename}: {error.strerror}"
    return _fail(command, error)


EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout's reader went away (`k3 generate … | head -1`)


def _interrupted(command: str, run, rerun) -> int:
    """Ctrl-C in a training-like command (train, quickstart, distill): where the run stood and the command that
    continues it; exit status 130 as a shell reports. run: the training loop (its `step` and its RunFolder
    `folder`), None before it existed; rerun(resume) -> the command line to suggest."""
    step = 0 if run is None else run.step
    saved = None if run is None else run.folder.newest_saved()
    if saved is None:
        print(
            f"\nk3 {command}: interrupted at step {step}, before the first checkpoint; start again with: "
            f"{rerun(False)}",
            file=sys.stderr,
        )
    else:
        print(
            f"\nk3 {command}: interrupted at step {step}; resume with: {rerun(True)} "
            f"(continues from step {saved}, the last checkpoint)",
            file=sys.stderr,
        )
    return EXIT_INTERRUPTED


def _device(name: str) -> str:
    """A device torch can use here, checked before any loading: cpu, cuda or cuda:N."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: k3 runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: torch sees no CUDA device here (`k3 env` shows what it sees)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 ...)")
    return str(device)


def _sampling(max_tokens: int, seed: int):
    from k3.serve.sampling import SamplingParams

    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=seed)
