"""`k3 train-draft`: train a speculative-decoding draft against a frozen model (k3.spec, docs/speculative.md)."""

import argparse
import json

from k3.cli.common import RUN_ERRORS, _run_error
from k3.formats.run_args import add_flags


def add_train_draft_parser(sub) -> None:
    """One flag per DraftTrainConfig field (k3.formats.run_args.add_flags)."""
    from k3.spec.train_draft import DraftTrainConfig

    p = sub.add_parser("train-draft", help="train a one-layer speculative-decoding draft against a frozen model")
    add_flags(p, DraftTrainConfig)
    p.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from k3.hub import load_for_inference
    from k3.spec.train_draft import DraftTrainConfig, prepare_data, start, train_draft

    def log(message: str) -> None:
        print(message, flush=True)

    try:
        cfg = DraftTrainConfig.from_flags(args)
        folder = start(cfg, log)  # --out, --resume and run.json checked before the model is read
        big, _ = load_for_inference(cfg.ckpt)
        train, held_out = prepare_data(big, cfg, folder, log)
    except (*RUN_ERRORS, KeyError) as e:
        return _run_error("train-draft", e)
    _, report = train_draft(big, train, held_out, cfg, log, folder)
    shown = (
        "tokens_per_step_greedy",
        "tokens_per_step_sampled",
        "greedy_acceptance_at",
        "alpha_at",
        "steps",
        "train_seconds",
    )
    print(json.dumps({k: report[k] for k in shown}))
    print(f"wrote {cfg.out}/ (serve it: k3 serve --model {cfg.ckpt} --speculative-model {cfg.out})")
    return 0
