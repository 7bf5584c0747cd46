"""`k3 train`, `k3 init` and `k3 quickstart`: the flags of a run, interruption, and what to run next."""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from k3.cli.common import EXIT_INTERRUPTED, RUN_ERRORS, _interrupted, _run_error, _sampling
from k3.config import PRESETS, K3Config
from k3.formats.run_args import add_flags, command_line

QUICKSTART_PROMPT = "def fibonacci(n):\n"
QUICKSTART_STEPS = 120
QUICKSTART_DEFAULTS = {"out": "runs/quickstart", "steps": QUICKSTART_STEPS, "eval_every": 25, "ckpt_every": 50}


def next_generate(run: str | Path) -> str:
    """The `k3 generate` line suggested after training: bash's $'...' quoting, so that the prompt holds a real
    newline rather than a backslash and an n; the run folder quoted for the shell."""
    import shlex

    return f"k3 generate --model {shlex.quote(str(run))} --max-tokens 200 --stream $'import os\\n'"


def _train_args(args: argparse.Namespace, **changes):
    """The TrainArgs of a parsed `k3 train`/`k3 quickstart` line, with `changes` to its values."""
    from k3.train.trainer import TrainArgs

    return TrainArgs.from_flags(args, **changes)


def _defaults(args: argparse.Namespace) -> dict:
    """The defaults the command's parser gave the TrainArgs fields that it changes (add_flags)."""
    return QUICKSTART_DEFAULTS if args.command == "quickstart" else {}


def _rerun_command(args: argparse.Namespace, train_args, resume: bool, **changes) -> str:
    """The `k3 train`/`k3 quickstart` line that repeats this one (flags that differ from the defaults), with
    `changes` to its values; --override left out (run.json now records what it accepted)."""
    import shlex

    resume = resume and args.command == "train"  # k3 quickstart resumes by itself
    flags = command_line(train_args, _defaults(args), resume=resume, override=False, **changes)
    parts = ["k3", args.command, *map(shlex.quote, flags)]
    if getattr(args, "nproc", 1) > 1:
        parts += ["--nproc", str(args.nproc)]
    return " ".join(parts)


def cmd_train(args: argparse.Namespace) -> int:
    """Train (or --resume) a K3 model; checkpoints, metrics.jsonl and tokenizer.json go to --out. With --nproc N
    (outside torchrun) the same command runs on N processes through torchrun (k3.train.distributed)."""
    from k3.train.distributed import launch, launched_by_torchrun

    try:
        train_args = _train_args(args)
    except RUN_ERRORS as e:
        return _run_error("train", e)
    if PRESETS[args.preset].get("vision_config") is not None:
        return _train_vision(args, train_args)
    if getattr(args, "nproc", 1) != 1 and not launched_by_torchrun():
        try:
            _check_launch(args, train_args)  # a mistake is one line here, not one per rank
            return launch(args.nproc, command_line(train_args))
        except RUN_ERRORS as e:
            return _run_error("train", e)
    if launched_by_torchrun():
        return _train_rank(args, train_args)
    if getattr(args, "ep", 1) != 1:
        return _run_error(
            "train",
            ValueError(
                f"--ep {args.ep} splits the experts over processes: add --nproc N "
                f"(a multiple of {args.ep}) or run under torchrun"
            ),
        )
    from k3.train.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(train_args)
        summary = trainer.train()
    except KeyboardInterrupt:
        return _interrupted("train", trainer, lambda resume: _rerun_command(args, train_args, resume))
    except RUN_ERRORS as e:
        return _run_error("train", e)
    _print_next(args, train_args, summary)
    return 0


def _train_vision(args: argparse.Namespace, train_args) -> int:
    """A vision preset (small-vl): the tower, projector and LM trained from scratch on generated images
    (k3.train.vision_trainer); one process."""
    import shlex

    from k3.train.vision_trainer import VisionTrainer

    trainer = None
    try:
        if getattr(args, "nproc", 1) != 1:
            raise ValueError(f"--preset {args.preset} trains in one process; drop --nproc")
        trainer = VisionTrainer(train_args)
        summary = trainer.train()
    except KeyboardInterrupt:
        return _interrupted("train", trainer, lambda resume: _rerun_command(args, train_args, resume))
    except RUN_ERRORS as e:
        return _run_error("train", e)
    print(json.dumps({k: summary[k] for k in ("step", "loss", "val_loss", "seconds")}))
    print(f"\nnext:\n  k3 generate --model {shlex.quote(args.out)} --image IMAGE.png 'How many shapes are there?'")
    return 0


def _check_launch(args: argparse.Namespace, train_args) -> None:
    """What every rank would refuse, checked once before torchrun starts them (TrainArgs checked its values)."""
    from k3.train.distributed import Parallel

    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    Parallel(0, args.nproc, train_args.ep, train_args.dp)
    if args.batch_size % args.nproc:
        raise ValueError(
            f"--batch-size {args.batch_size} must be a multiple of --nproc {args.nproc}: each process "
            f"takes an equal share of every micro-batch"
        )


def _train_rank(args: argparse.Namespace, train_args) -> int:
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
        trainer = Trainer(train_args, log=log, parallel=parallel)
        summary = trainer.train()
        finished = True
    except KeyboardInterrupt:
        if rank != "0":
            return EXIT_INTERRUPTED
        return _interrupted("train", trainer, lambda resume: _rerun_command(args, train_args, resume))
    except (PeerFailure, Stopped) as e:
        saved = None if trainer is None else trainer.folder.saved_step
        where = "before the first checkpoint" if saved is None else f"the last checkpoint is step {saved}"
        rerun = _rerun_command(args, train_args, resume=True)
        message = f"k3 train (rank {rank}): stopping: {e}; {where}; resume with: {rerun}"
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
        _print_next(args, train_args, summary)
    return 0


def _print_next(args: argparse.Namespace, train_args, summary) -> None:
    print(json.dumps({k: v for k, v in summary.items() if k != "maxvio"}))
    import shlex

    out, model = shlex.quote(args.out), shlex.quote(args.out.rstrip("/") + "-model")
    print(
        f"\nnext:\n  {next_generate(args.out)}\n"
        f"  k3 plot {out}    # loss.png and maxvio.png in the run folder\n"
        f"  {_rerun_command(args, train_args, resume=True, steps=2 * args.steps)}    # train twice as long\n"
        f"  k3 export --ckpt {out} --out {model}    # a model folder for k3, vLLM or SGLang"
    )


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
    print(
        f"k3 quickstart: training the small K3 preset for {args.steps} steps on the Python standard library's "
        f"source ({args.batch_size} × {args.seq_len} tokens per step), writing to {out}/"
    )
    trainer = train_args = None
    try:
        train_args = _train_args(args, resume=out.is_dir() and bool(step_dirs(out)))
        trainer = Trainer(train_args)
        n = sum(p.numel() for p in trainer.model.parameters())
        print(
            f"model: {n / 1e6:.1f}M parameters, {trainer.config.num_hidden_layers} layers "
            f"({trainer.config.layer_types.count('kda')} KDA + {trainer.config.layer_types.count('mla')} MLA), "
            f"{trainer.train_data.num_sequences * args.seq_len / 1e6:.1f}M training tokens"
        )
        summary = trainer.train()
        # eager steps: the demo's few hundred tokens take less time than compiling the step would
        llm = LLM(str(out), memory_budget=64 << 20, compile=False)
    except KeyboardInterrupt:
        return _interrupted("quickstart", trainer, lambda resume: _rerun_command(args, train_args, resume))
    except RUN_ERRORS as e:
        return _run_error("quickstart", e)
    print(f"\nvalidation loss: {summary['val_loss']:.3f} nats/token after {trainer.step} steps")
    sample = llm.generate(QUICKSTART_PROMPT, _sampling(args.sample_tokens, seed=0))[0]
    rule = "-" * 60
    print(f"\nsample (temperature 0.8, top-p 0.95, seed 0):\n{rule}\n{QUICKSTART_PROMPT}{sample.text}\n{rule}")
    _serve_demo(llm, args.sample_tokens)
    for path in plot_run(out):
        print(f"wrote {path}")
    print(
        f"\nnext:\n  {next_generate(out)}\n"
        f"  k3 train --preset small --steps 2000 --out runs/longer     # train longer\n"
        f"  k3 params --preset k3                                      # the full 2.8T model, counted"
    )
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
    print(
        f"\nserved {requests - 1} more requests sharing their first {shared} prompt tokens in "
        f"{seconds:.1f} s, batched: {sum(len(o.token_ids) for o in outs) / seconds:.0f} output tokens/s; "
        f"{sum(o.num_cached_tokens for o in outs):,} of {sum(o.num_prompt_tokens for o in outs):,} prompt tokens "
        f"came from the prefix cache ({m['state_hit_tokens']:,} resumed from KDA checkpoints)"
    )
    print(llm.engine.describe().splitlines()[0])


def _add_train_flags(p: argparse.ArgumentParser, **defaults) -> None:
    """One flag per TrainArgs field (k3.formats.run_args.add_flags): help, default and choices from the field."""
    from k3.train.trainer import TrainArgs

    add_flags(p, TrainArgs, **defaults)
