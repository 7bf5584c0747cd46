"""`k3 train-draft`: train a speculative-decoding draft against a frozen model (k3.spec, docs/speculative.md)."""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch


def add_train_draft_parser(sub) -> None:
    p = sub.add_parser("train-draft", help="train a one-layer speculative-decoding draft against a frozen model")
    p.add_argument("--ckpt", "--model", dest="ckpt", required=True,
                   help="the big model: a run folder, a step_* folder or a model folder")  # fmt: skip
    p.add_argument("--out", required=True, help="the draft folder to write (draft.json, draft.safetensors)")
    p.add_argument("--mode", choices=("chain", "block"), default="chain",
                   help="chain: k autoregressive steps (the seed's draft); block: all k in one forward")  # fmt: skip
    p.add_argument("--objective", choices=("alpha", "kl", "blend"), default="alpha",
                   help="-log of the acceptance rate, KL to the big model, or KL early and alpha late")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=int, default=7, help="proposals per step (default 7)")
    p.add_argument("--steps", type=int, default=300, help="training steps at most (default 300)")
    p.add_argument("--time-limit", type=float, default=240.0, help="seconds of training at most (default 240)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    p.add_argument("--data", default=None,
                   help="token corpus (.npy) for prompts (default: train_tokens.npy of the run folder)")  # fmt: skip
    p.add_argument("--val-data", default=None, help="held-out corpus (.npy) for evaluation prompts "
                   "(default: the run's val_tokens.npy)")  # fmt: skip
    p.add_argument("--continuations", default=None, help="a continuations.pt written by an earlier "
                   "train-draft, to reuse instead of generating")  # fmt: skip
    p.add_argument("--train-sequences", type=int, default=96, help="continuations to train on (default 96)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.set_defaults(func=cmd_train_draft)


def _corpus(explicit: str | None, ckpt: Path, name: str) -> np.ndarray:
    """The .npy corpus given, or `name` in the checkpoint's run folder (the folder or its parent)."""
    candidates = [Path(explicit)] if explicit else [ckpt / name, ckpt.parent / name]
    for path in candidates:
        if path.is_file():
            return np.load(path, mmap_mode="r")
    raise FileNotFoundError(f"no token corpus: looked for {', '.join(map(str, candidates))}; pass --data/--val-data")


def cmd_train_draft(args: argparse.Namespace) -> int:
    from k3.hub import load_for_inference
    from k3.spec.folder import save_draft
    from k3.spec.train_draft import DraftTrainConfig, continuations, train_draft

    try:
        cfg = DraftTrainConfig(mode=args.mode, objective=args.objective, steps=args.steps,
                               time_limit_s=args.time_limit, lr=args.lr, seed=args.seed,
                               num_speculative_tokens=args.num_speculative_tokens,
                               train_sequences=args.train_sequences)  # fmt: skip
        ckpt = Path(args.ckpt)
        big, _ = load_for_inference(ckpt)
        out = Path(args.out)
        if args.continuations:
            data = torch.load(args.continuations)
            train, held_out = data["train"], data["eval"]
        else:
            print(f"k3 train-draft: continuing {cfg.train_sequences} + {cfg.eval_sequences} prompts with the model",
                  flush=True)  # fmt: skip
            train = continuations(big, _corpus(args.data, ckpt, "train_tokens.npy"), cfg.train_sequences, cfg,
                                  seed=cfg.seed)  # fmt: skip
            held_out = continuations(big, _corpus(args.val_data, ckpt, "val_tokens.npy"), cfg.eval_sequences, cfg,
                                     seed=cfg.seed + 10_000)  # fmt: skip
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"train": train, "eval": held_out}, out / "continuations.pt")
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"k3 train-draft: {e}", file=sys.stderr)
        return 2
    draft, report = train_draft(big, train, held_out, cfg, log=lambda s: print(s, flush=True))
    save_draft(draft, big, out, training={k: v for k, v in report.items()})
    shown = ("tokens_per_step_greedy", "tokens_per_step_sampled", "greedy_acceptance_at", "alpha_at", "steps",
             "train_seconds")  # fmt: skip
    print(json.dumps({k: report[k] for k in shown}))
    print(f"wrote {out}/ (serve it: k3 serve --model {args.ckpt} --speculative-model {out})")
    return 0
