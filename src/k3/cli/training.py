"""`k3 train`, `k3 init` and `k3 quickstart`: the flags of a run, interruption, and what to run next."""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from k3.cli.common import EXIT_INTERRUPTED, RUN_ERRORS, _interrupted, _run_error, _sampling
from k3.config import PRESETS, K3Config

QUICKSTART_PROMPT = "def fibonacci(n):\n"
QUICKSTART_STEPS = 120


def next_generate(run: str | Path) -> str:
    """The `k3 generate` line suggested after training: bash's $'...' quoting, so that the prompt holds a real
    newline rather than a backslash and an n; the run folder quoted for the shell."""
    import shlex

    return f"k3 generate --ckpt {shlex.quote(str(run))} --max-tokens 200 --stream $'import os\\n'"


def _train_args(args: argparse.Namespace, **overrides):
    from k3.train.trainer import TrainArgs

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainArgs) if hasattr(args, f.name)}
    return TrainArgs(**{**values, **overrides})


def _flags(args: argparse.Namespace, **changes) -> list[str]:
    """The flags of a `k3 train`/`k3 quickstart` line that differ from the defaults, with `changes` to their
    values (--resume and --override left out)."""
    from k3.train.trainer import TrainArgs

    defaults = vars(_parser().parse_args([args.command, "--out", args.out]))
    parts = []
    for f in dataclasses.fields(TrainArgs):
        value = changes.get(f.name, getattr(args, f.name))
        if f.name in ("resume", "override") or (f.name != "out" and value == defaults[f.name]):
            continue
        if f.name == "progress":
            parts.append("--no-progress")
        elif isinstance(value, bool):
            if value:
                parts.append("--" + f.name.replace("_", "-"))
        else:
            parts += ["--" + f.name.replace("_", "-"), str(value)]
    return parts


def _rerun_command(args: argparse.Namespace, resume: bool, **changes) -> str:
    """The `k3 train`/`k3 quickstart` line that repeats this one (flags that differ from the defaults), with
    `changes` to its values."""
    import shlex

    parts = ["k3", args.command, *map(shlex.quote, _flags(args, **changes))]
    if getattr(args, "nproc", 1) > 1:
        parts += ["--nproc", str(args.nproc)]
    if resume and args.command == "train":
        parts.append("--resume")
    return " ".join(parts)


def cmd_train(args: argparse.Namespace) -> int:
    """Train (or --resume) a K3 model; checkpoints, metrics.jsonl and tokenizer.json go to --out. With --nproc N
    (outside torchrun) the same command runs on N processes through torchrun (k3.train.distributed)."""
    from k3.train.distributed import launch, launched_by_torchrun

    if PRESETS[args.preset].get("vision_config") is not None:
        return _train_vision(args)
    if getattr(args, "nproc", 1) != 1 and not launched_by_torchrun():
        try:
            _check_launch(args)  # a mistake is one line here, not one per rank
            argv = [*_flags(args), *(["--resume"] if args.resume else []), *(["--override"] if args.override else [])]
            return launch(args.nproc, argv)
        except RUN_ERRORS as e:
            return _run_error("train", e)
    if launched_by_torchrun():
        return _train_rank(args)
    if getattr(args, "ep", 1) != 1:
        return _run_error("train", ValueError(f"--ep {args.ep} splits the experts over processes: add --nproc N "
                                              f"(a multiple of {args.ep}) or run under torchrun"))  # fmt: skip
    from k3.train.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(_train_args(args))
        summary = trainer.train()
    except KeyboardInterrupt:
        return _interrupted("train", trainer, lambda resume: _rerun_command(args, resume))
    except RUN_ERRORS as e:
        return _run_error("train", e)
    _print_next(args, summary)
    return 0


def _train_vision(args: argparse.Namespace) -> int:
    """A vision preset (small-vl): the tower, projector and LM trained from scratch on generated images
    (k3.train.vision_trainer); one process."""
    import shlex

    from k3.train.vision_trainer import train_vision

    try:
        if getattr(args, "nproc", 1) != 1:
            raise ValueError(f"--preset {args.preset} trains in one process; drop --nproc")
        summary = train_vision(_train_args(args))
    except RUN_ERRORS as e:
        return _run_error("train", e)
    print(json.dumps({k: summary[k] for k in ("step", "loss", "val_loss", "seconds")}))
    print(f"\nnext:\n  k3 generate --model {shlex.quote(args.out)} --image IMAGE.png 'How many shapes are there?'")
    return 0


def _check_launch(args: argparse.Namespace) -> None:
    """What every rank would refuse, checked once before torchrun starts them."""
    from k3.train.distributed import Parallel

    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    _train_args(args)
    Parallel(0, args.nproc, args.ep, args.dp)
    if args.batch_size % args.nproc:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of --nproc {args.nproc}: each process "
                         f"takes an equal share of every micro-batch")  # fmt: skip


def _train_rank(args: argparse.Namespace) -> int:
    """One process of a torchrun launch: rank 0 prints as `k3 train` does; every rank logs to its own file in
    <out>/logs/; a rank whose peer died says so and exits 1 (torchrun then stops the rest and reports)."""
    from k3.train.distributed import PeerFailure, RankLog, Stopped, init_parallel, shutdown, stop_on_sigterm
    from k3.train.trainer import Trainer

    trainer, log, rank, finished = None, None, os.environ.get("RANK", "?"), False
    stop_on_sigterm()
    try:
        parallel = init_parallel(args.dp, args.ep)
        args.nproc = parallel.world_size  # for the commands suggested (a --nproc here would confuse torchrun)
        log = RankLog(parallel.rank)
        trainer = Trainer(_train_args(args), log=log, parallel=parallel)
        summary = trainer.train()
        finished = True
    except KeyboardInterrupt:
        return (
            _interrupted("train", trainer, lambda resume: _rerun_command(args, resume))
            if rank == "0"
            else EXIT_INTERRUPTED
        )
    except (PeerFailure, Stopped) as e:
        saved = None if trainer is None else trainer.saved_step
        where = "before the first checkpoint" if saved is None else f"the last checkpoint is step {saved}"
        message = f"k3 train (rank {rank}): stopping: {e}; {where}; resume with: {_rerun_command(args, resume=True)}"
        print(message, file=sys.stderr, flush=True)
        if log is not None:
            log(message)
        return 1
    except RUN_ERRORS as e:
        return _run_error(f"train (rank {rank})", e)
    finally:
        if log is not None:
            log.close()
        shutdown(finished)
    if rank == "0":
        _print_next(args, summary)
    return 0


def _print_next(args: argparse.Namespace, summary) -> None:
    print(json.dumps({k: v for k, v in summary.items() if k != "maxvio"}))
    import shlex

    out, model = shlex.quote(args.out), shlex.quote(args.out.rstrip("/") + "-model")
    print(f"\nnext:\n  {next_generate(args.out)}\n"
          f"  k3 plot {out}    # loss.png and maxvio.png in the run folder\n"
          f"  {_rerun_command(args, resume=True, steps=2 * args.steps)}    # train twice as long\n"
          f"  k3 export --ckpt {out} --out {model}    # a model folder for k3, vLLM or SGLang")  # fmt: skip


def cmd_init(args: argparse.Namespace) -> int:
    """A randomly initialised checkpoint with a byte-level tokenizer: for tests and servers that need no training."""
    from k3.formats.checkpoint import save_checkpoint, step_dirs
    from k3.formats.tokenizer import byte_tokenizer
    from k3.model import K3Model
    from k3.train.optim import build_optimizer

    out = Path(args.out)
    try:
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file; a checkpoint folder is a directory (choose another --out)")
        if step_dirs(out):
            raise ValueError(f"{out} already holds checkpoints; choose a new --out")
        tokenizer = byte_tokenizer()
        config = K3Config.from_preset(args.preset, vocab_size=tokenizer.vocab_size)
        torch.manual_seed(args.seed)
        model = K3Model(config)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save(out / "tokenizer.json")
        state = {"position": 0, "tokenizer": "tokenizer.json", "init": {"preset": args.preset, "seed": args.seed}}
        path = save_checkpoint(out, 0, model, build_optimizer(model, lr=1e-3, weight_decay=0.0), config, state)
    except RUN_ERRORS as e:
        return _run_error("init", e)
    print(f"wrote {path} ({sum(p.numel() for p in model.parameters()):,} parameters, preset {args.preset})")
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    """Train the small preset on the standard library's source, then sample from it and serve a batch
    of requests through the engine, and plot the run."""
    from k3.formats.checkpoint import step_dirs
    from k3.serve.llm import LLM
    from k3.train.plot import plot_run
    from k3.train.trainer import Trainer

    out = Path(args.out)
    print(f"k3 quickstart: training the small K3 preset for {args.steps} steps on the Python standard library's "
          f"source ({args.batch_size} × {args.seq_len} tokens per step), writing to {out}/")  # fmt: skip
    trainer = None
    try:
        trainer = Trainer(_train_args(args, resume=out.is_dir() and bool(step_dirs(out))))
        n = sum(p.numel() for p in trainer.model.parameters())
        print(f"model: {n / 1e6:.1f}M parameters, {trainer.config.num_hidden_layers} layers "
              f"({trainer.config.layer_types.count('kda')} KDA + {trainer.config.layer_types.count('mla')} MLA), "
              f"{trainer.train_data.num_sequences * args.seq_len / 1e6:.1f}M training tokens")  # fmt: skip
        summary = trainer.train()
        llm = LLM(str(out), memory_budget=64 << 20)
    except KeyboardInterrupt:
        return _interrupted("quickstart", trainer, lambda resume: _rerun_command(args, resume))
    except RUN_ERRORS as e:
        return _run_error("quickstart", e)
    print(f"\nvalidation loss: {summary['val_loss']:.3f} nats/token after {trainer.step} steps")
    sample = llm.generate(QUICKSTART_PROMPT, _sampling(args.sample_tokens, seed=0))[0]
    rule = "-" * 60
    print(f"\nsample (temperature 0.8, top-p 0.95, seed 0):\n{rule}\n{QUICKSTART_PROMPT}{sample.text}\n{rule}")
    _serve_demo(llm, args.sample_tokens)
    for path in plot_run(out):
        print(f"wrote {path}")
    print(f"\nnext:\n  {next_generate(out)}\n"
          f"  k3 train --preset small --steps 2000 --out runs/longer     # train longer\n"
          f"  k3 params --preset k3                                      # the full 2.8T model, counted")  # fmt: skip
    return 0


def _serve_demo(llm, max_tokens: int, requests: int = 8) -> None:
    """What serving adds: requests sharing a prefix (a stdlib module's opening), batched by the engine,
    the shared part read from the prefix cache after the first request computed it."""
    import textwrap
    import time

    prefix = Path(textwrap.__file__).read_text(encoding="utf-8")[:1500]
    prompts = [f"{prefix}\n\ndef helper_{i}(text):\n" for i in range(requests)]
    llm.generate(prompts[0], _sampling(1, seed=0))  # the first request: computes the prefix, fills the cache
    start = time.perf_counter()
    outs = llm.generate(prompts[1:], [_sampling(max_tokens, seed=i) for i in range(1, requests)])
    seconds = time.perf_counter() - start
    m = llm.engine.metrics()
    a, b = (llm.tokenizer.encode(p) for p in prompts[:2])
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    print(f"\nserved {requests - 1} more requests sharing their first {shared} prompt tokens in "
          f"{seconds:.1f} s, batched: {sum(len(o.token_ids) for o in outs) / seconds:.0f} output tokens/s; "
          f"{sum(o.num_cached_tokens for o in outs):,} of {sum(o.num_prompt_tokens for o in outs):,} prompt tokens "
          f"came from the prefix cache ({m['state_hit_tokens']:,} resumed from KDA checkpoints)")  # fmt: skip
    print(llm.engine.describe().splitlines()[0])


TRAIN_CHOICES = {
    "preset": sorted(PRESETS),
    "schedule": ["cosine", "wsd"],
    "balancer": ["quantile", "fixed", "none"],
    "expert_optimizer": ["muon", "muon-active", "adamw"],
    "dp": ["ddp", "fsdp"],
}


def _add_train_flags(p: argparse.ArgumentParser, **defaults) -> None:
    """One flag per TrainArgs field, its help line from the field's metadata with the default shown."""
    from k3.train.trainer import TrainArgs

    for f in dataclasses.fields(TrainArgs):
        default = defaults.get(f.name, f.default)
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata["help"].replace("%", "%%")
        if f.name == "progress":
            p.add_argument("--no-progress", dest="progress", action="store_false", default=default,
                           help="no progress bar (default: a progress bar on stderr)")  # fmt: skip
        elif f.type is bool:
            p.add_argument(flag, action="store_true", default=default, help=f"{text} (default: off)")
        elif default is dataclasses.MISSING:
            p.add_argument(flag, required=True, help=f"{text} (required)")
        else:
            kind = f.type if f.type in (int, float) else str
            shown = " (default: %(default)s)" if default is not None else ""
            shown = shown or ("" if "default" in text else " (default: none)")
            p.add_argument(flag, type=kind, default=default, help=text + shown,
                           **({"choices": TRAIN_CHOICES[f.name]} if f.name in TRAIN_CHOICES else {}))  # fmt: skip


def _parser():
    """The full parser (imported here: the parser module imports this one)."""
    from k3.cli.parser import build_parser

    return build_parser()
