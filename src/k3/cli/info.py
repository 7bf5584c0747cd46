"""`k3 env` and `k3 params`: what k3 runs on here, and a configuration counted."""

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

import k3
from k3.config import ConfigError, K3Config
from k3.model.params import format_report, param_report


def cmd_env(args: argparse.Namespace) -> int:
    """What k3 will run on here: versions, threads, devices, and which KDA backend each device gets."""
    from k3.ops.kda import cpu_kernel
    from k3.ops.kda.backend import ENV_VAR, describe, fla_kda, fla_version, fla_version_tested

    version = fla_version()
    if version is None:
        fla = "not installed (pip install 'k3[cuda]' on a CUDA machine)"
    elif not fla_version_tested(version):
        fla = f"{version}: untested, not used (k3 is tested with the range in pyproject's cuda extra)"
    else:
        fla = f"{version}: kernels " + ("importable" if fla_kda() is not None else "not importable (no Triton/GPU)")
    rows = [
        ("k3", k3.__version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("cpu threads", str(torch.get_num_threads())),
        ("cuda", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not available"),
        ("flash-linear-attention", fla),
        (ENV_VAR, os.environ.get(ENV_VAR, "unset (auto)")),
        ("KDA backend on cpu", describe("cpu")),
        ("KDA chunked op on cpu", cpu_kernel.describe()),
    ]
    if torch.cuda.is_available():
        rows.append(("KDA backend on cuda", describe("cuda")))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def cmd_params(args: argparse.Namespace) -> int:
    """Parameters by component (total and active), FLOPs per token, MLA cache and KDA state sizes."""
    try:
        if args.config is None:
            config, source = K3Config.from_preset(args.preset or "k3"), f"preset {args.preset or 'k3'}"
        else:
            config, source = _config_of(Path(args.config)), args.config
    except (ValueError, OSError) as e:  # ConfigError and CheckpointError are ValueErrors
        print(f"k3 params: {e}", file=sys.stderr)
        return 2
    report = param_report(config, context=args.context)
    memory = None
    if getattr(args, "ep", None) is not None or getattr(args, "dp", None) is not None:
        from k3.train.rank_memory import format_rank_memory, rank_memory

        ep = args.ep or 1
        try:
            memory = rank_memory(config, ep, args.dp or ep, args.micro_batch_tokens)
        except ValueError as e:
            print(f"k3 params: {e}", file=sys.stderr)
            return 2
        report["rank_memory"] = memory
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report, source) + ("" if memory is None else "\n\n" + format_rank_memory(memory)))
    return 0


def _config_of(path: Path) -> K3Config:
    """The config of a config.json, a model folder, or a run or step folder (its meta.json; the tensors are
    not read)."""
    from k3.formats.checkpoint import load_checkpoint

    if path.is_dir() and not (path / "config.json").exists():
        if (path / "meta.json").exists() or any(path.glob("step_*/meta.json")):
            return load_checkpoint(path, check_digests=False).config
        raise ConfigError(f"{path}: no config.json, and not a run or step folder (no meta.json)")
    return K3Config.from_hf(path)
