"""Training a draft against a frozen big model (`k3 train-draft`, SPEC §3).

Data: windows of the run's token corpus as prompts, continued by the big model itself (greedy by
default), so the draft learns the distribution it will be verified against, on text the big model
writes. Each training row is a start position t of a continuation: the draft gets the big model's
block summaries at t and the tokens t+1 … t+k, and is unrolled over its k steps exactly as at
inference (its own hidden state fed forward); step j is compared with the big model's distribution p
at position t+1+j (the distribution of token t+2+j).

Objectives, per step j, with q the draft's distribution:
- "kl": KL(p ‖ q) = Σₓ p log(p / q), the usual proxy;
- "alpha": −log α with α = Σₓ min(p(x), q(x)), the probability that rejection sampling accepts the
  proposal (Leviathan et al. 2023): the acceptance rate itself is maximised;
- "blend": KL early, α late (weight of α rising linearly over the run), as the issue suggests.

Evaluation on held-out continuations (the validation split's prompts): per draft position, the greedy
acceptance (argmax q equals the big model's token, given every earlier proposal accepted) and α, and the
mean tokens a verify step emits (accepted + 1), greedy and expected under sampling.

The output is a run folder (k3.formats.run_folder) as every training loop writes one: run.json,
metrics.jsonl, step_*/ checkpoints that --resume continues (the draft's weights, AdamW's state and the batch
generator's; the config recorded is the big model's), continuations.safetensors (the data, so that a resumed
run trains on the same) and, once training ends, the draft: draft.json and draft.safetensors (k3.spec.folder).
"""

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.formats.files import atomic_write
from k3.formats.run_args import RunArgs, arg
from k3.formats.run_folder import RunFolder
from k3.formats.run_record import RunRecord
from k3.model.generate import generate
from k3.model.model import K3Model
from k3.spec.draft import DEFAULT_NUM_SPECULATIVE_TOKENS, DraftModel
from k3.spec.features import block_summaries
from k3.spec.folder import save_draft

OBJECTIVES = ("kl", "alpha", "blend")
MODES = ("chain", "block")
CONTINUATIONS = "continuations.safetensors"
# What the continuations are made from: an --override of one of these makes them again (k3.formats.run_folder).
DATA_INPUTS = {"--ckpt", "--data", "--val-data", "--continuations", "--train-sequences", "--eval-sequences"}
DERIVED = {CONTINUATIONS: {*DATA_INPUTS, "--prompt-tokens", "--new-tokens", "--temperature", "--seed"}}
LOG_EVERY = 20  # steps between log lines when no progress bar shows


@dataclass(kw_only=True)
class DraftTrainConfig(RunArgs):
    """`k3 train-draft`'s flags (the run folder's own, from RunArgs, first)."""

    out: str = arg(
        help="the draft folder: draft.json, draft.safetensors, run.json, metrics.jsonl, step_*/", recorded=False
    )
    steps: int = arg(300, "training steps at most (with --resume: raise it to train longer)", recorded=False)
    seed: int = arg(0, "seed of the draft's initialisation, the prompts and the batches")
    ckpt: str = arg(help="the big model: a run, step_* or model folder", path=True, aliases=("--model",))
    data: str | None = arg(
        None, "token corpus (.npy) for prompts (default: the run folder's train_tokens.npy)", path=True
    )
    val_data: str | None = arg(
        None, "held-out corpus (.npy) for evaluation prompts (default: the run's val_tokens.npy)", path=True
    )
    continuations: str | None = arg(
        None, "the continuations of an earlier train-draft, to reuse instead of generating", path=True
    )
    mode: str = arg(
        "chain", "chain: k autoregressive steps (the seed's draft); block: all k in one forward", choices=MODES
    )
    objective: str = arg(
        "alpha", "-log of the acceptance rate, KL to the big model, or KL early and alpha late", choices=OBJECTIVES
    )
    num_speculative_tokens: int = arg(DEFAULT_NUM_SPECULATIVE_TOKENS, "proposals per step")
    time_limit_s: float = arg(
        240.0, "seconds of training at most, whatever --steps", recorded=False, aliases=("--time-limit",)
    )
    lr: float = arg(2e-3, "AdamW learning rate")
    batch_sequences: int = arg(4, "continuations per step")
    starts_per_sequence: int = arg(24, "start positions t drawn from each")
    prompt_tokens: int = arg(32, "tokens of each prompt")
    new_tokens: int = arg(64, "tokens the big model continues each prompt with")
    train_sequences: int = arg(96, "continuations to train on")
    eval_sequences: int = arg(24, "held-out continuations to evaluate on")
    temperature: float = arg(0.0, "of the big model's continuations (0: greedy)")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.at_least(1, "num_speculative_tokens", "batch_sequences", "starts_per_sequence", "prompt_tokens")
        self.at_least(1, "train_sequences", "eval_sequences")
        if self.new_tokens <= self.num_speculative_tokens + 1:
            raise ValueError(f"new_tokens ({self.new_tokens}) must exceed num_speculative_tokens + 1")


def token_corpus(explicit: str | None, ckpt: Path, name: str) -> np.ndarray:
    """The .npy corpus given, or `name` in the checkpoint's run folder (the folder or its parent)."""
    candidates = [Path(explicit)] if explicit else [ckpt / name, ckpt.parent / name]
    for path in candidates:
        if path.is_file():
            return np.load(path, mmap_mode="r")
    raise FileNotFoundError(f"no token corpus: looked for {', '.join(map(str, candidates))}; pass --data/--val-data")


def read_continuations(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) token ids of a continuations file: safetensors, or a continuations.pt k3 wrote before,
    read with torch.load(weights_only=True) (tensors only: no pickled code runs)."""
    path = Path(path)
    try:
        data = torch.load(path, weights_only=True) if path.suffix == ".pt" else load_file(path)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"--continuations {path}: not a continuations file ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), torch.Tensor) for k in ("train", "eval")):
        raise ValueError(f"--continuations {path}: holds no train and eval token tensors")
    return data["train"], data["eval"]


def start(cfg: DraftTrainConfig, log=print) -> RunFolder:
    """The draft's run folder, checked against --out, --resume and run.json (reads only; open() writes)."""
    folder = RunFolder(cfg, log)
    folder.reconcile(RunRecord(cfg.recorded(), None, None, None, []), folder.resume_from(), derived=DERIVED)
    return folder


def prepare_data(
    big: K3Model, cfg: DraftTrainConfig, folder: RunFolder, log=print
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) continuations: the folder's own (a resume), --continuations, or the big model's
    continuations of prompts from the corpora; written to the folder, which this opens."""
    own = folder.path / CONTINUATIONS
    if own.is_file() and CONTINUATIONS not in folder.stale:
        data = read_continuations(own)
    elif cfg.continuations:
        data = read_continuations(cfg.continuations)
    else:
        corpora = [
            token_corpus(path, Path(cfg.ckpt), name)
            for path, name in ((cfg.data, "train_tokens.npy"), (cfg.val_data, "val_tokens.npy"))
        ]
        log(f"k3 train-draft: continuing {cfg.train_sequences} + {cfg.eval_sequences} prompts with the model")
        data = (
            continuations(big, corpora[0], cfg.train_sequences, cfg, seed=cfg.seed),
            continuations(big, corpora[1], cfg.eval_sequences, cfg, seed=cfg.seed + 10_000),
        )
    folder.open()
    if not own.is_file():
        tensors = {"train": data[0].contiguous(), "eval": data[1].contiguous()}
        atomic_write(own, lambda tmp: save_file(tensors, str(tmp)))
    return data


@torch.no_grad()
def continuations(
    big: K3Model, corpus: np.ndarray, n: int, cfg: DraftTrainConfig, seed: int, batch: int = 32
) -> torch.Tensor:
    """n prompts of cfg.prompt_tokens tokens drawn from the corpus, each continued by the big model for
    cfg.new_tokens tokens -> (n, prompt_tokens + new_tokens) token ids."""
    P = cfg.prompt_tokens
    if len(corpus) < P + 1:
        raise ValueError(f"the corpus has {len(corpus)} tokens; need more than {P}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(corpus) - P, size=n)
    prompts = torch.from_numpy(np.stack([corpus[s : s + P] for s in starts]).astype(np.int64))
    out = [
        generate(big, prompts[i : i + batch], cfg.new_tokens, temperature=cfg.temperature, seed=seed + i)
        for i in range(0, n, batch)
    ]
    return torch.cat(out)


@torch.no_grad()
def big_targets(big: K3Model, draft: DraftModel, tokens: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """tokens (B, T) -> the draft's block summaries (B, T, d) each and the big model's log p (B, T, V)."""
    with block_summaries(big) as capture:
        logits = big(tokens).logits
        summaries = capture.summaries(draft.feature_blocks)
    return summaries, torch.log_softmax(logits.float(), dim=-1)


def rows(tokens: torch.Tensor, summaries: list[torch.Tensor], logp: torch.Tensor, starts: torch.Tensor, k: int):
    """Start positions (B, S) -> the unrolled rows: summaries at t (R, d) each, tokens t+1 … t+k (R, k),
    log p at t+1 … t+k (R, k, V), R = B·S."""
    b = torch.arange(tokens.shape[0])[:, None].expand_as(starts).flatten()
    t = starts.flatten()
    offsets = t[:, None] + 1 + torch.arange(k)[None]  # (R, k)
    feats = [s[b, t] for s in summaries]
    return feats, tokens[b[:, None], offsets], logp[b[:, None], offsets]


def step_losses(draft_logits: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, k, V) draft logits and big log p -> per-step mean KL(p ‖ q) and mean −log α, (k,) each."""
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    p = logp.exp()
    kl = (p * (logp - logq)).sum(-1).mean(0)
    alpha = torch.minimum(p, logq.exp()).sum(-1).clamp_min(1e-9)
    return kl, -alpha.log().mean(0)


def walk_tokens_per_step(runs: torch.Tensor) -> float:
    """runs (n_seq, S): accepted proposals from each start position of each continuation -> tokens per verify
    step as the engine walks it (a step from t emits runs[t] + 1 tokens and the next starts after them).
    The mean over every start position would overweight the easy stretches the engine jumps over."""
    steps = tokens = 0
    for row in runs.tolist():
        t = 0
        while t < len(row):
            steps, tokens, t = steps + 1, tokens + row[t] + 1, t + row[t] + 1
    return tokens / max(1, steps)


@torch.no_grad()
def evaluate(big: K3Model, draft: DraftModel, data: torch.Tensor, prompt_tokens: int, batch: int = 8) -> dict:
    """Per draft position: greedy acceptance given the earlier ones accepted, and mean α; tokens a verify step
    emits, greedy (walked as the engine does) and expected under sampling (temperature 1, per position)."""
    k = draft.num_speculative_tokens
    match_all, alpha_all, runs = [], [], []
    for i in range(0, len(data), batch):
        tokens = data[i : i + batch]
        summaries, logp = big_targets(big, draft, tokens)
        T = tokens.shape[1]
        starts = torch.arange(prompt_tokens - 1, T - k - 1)[None].expand(len(tokens), -1)
        feats, toks, lp = rows(tokens, summaries, logp, starts, k)
        q_logits = draft.unroll(toks, draft.features(feats))
        # the big model's token at t+2+j is argmax p there (greedy continuations): compare with argmax q
        match_all.append(q_logits.argmax(-1) == lp.argmax(-1))
        runs.append(torch.cumprod(match_all[-1].long(), 1).sum(1).view(len(tokens), -1))
        alpha_all.append(torch.minimum(lp.exp(), torch.softmax(q_logits.float(), -1)).sum(-1))
    match, alpha = torch.cat(match_all).double(), torch.cat(alpha_all).double()
    reached = torch.cumprod(torch.cat([torch.ones_like(match[:, :1]), match[:, :-1]], 1), 1)
    accepted_at = ((match * reached).sum(0) / reached.sum(0).clamp_min(1)).tolist()
    greedy_len = walk_tokens_per_step(torch.cat(runs))
    sampled_len = torch.cumprod(alpha, 1).sum(1).mean().item() + 1
    return {
        "tokens_per_step_greedy": greedy_len,
        "tokens_per_step_sampled": sampled_len,
        "greedy_acceptance_at": accepted_at,
        "alpha_at": alpha.mean(0).tolist(),
        "rows": len(match),
    }


def train_draft(
    big: K3Model,
    train_data: torch.Tensor,
    eval_data: torch.Tensor,
    cfg: DraftTrainConfig,
    log=print,
    folder: RunFolder | None = None,
) -> tuple[DraftModel, dict]:
    """Train a draft against the frozen big model on its continuations, in the run folder `folder` (default:
    cfg.out, opened here), from its newest checkpoint with --resume; writes the draft there -> (draft, report)."""
    if folder is None:
        folder = start(cfg, log)
        folder.open()
    torch.manual_seed(cfg.seed)
    for p in big.parameters():
        p.requires_grad_(False)
    big.eval()
    draft = DraftModel(big.config, cfg.mode, cfg.num_speculative_tokens).attach(big)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.0)
    k, P = cfg.num_speculative_tokens, cfg.prompt_tokens
    gen = torch.Generator().manual_seed(cfg.seed)
    step, spent_s = 0, 0.0  # steps and training seconds before this run (a resume)
    if folder.resumed is not None:
        ckpt = folder.resumed
        ckpt.load_model(draft)
        ckpt.load_optimizer(opt, draft)
        extra = ckpt.tensors("extra.safetensors")
        torch.set_rng_state(extra["rng.torch"])
        gen.set_state(extra["rng.batches"])
        step, spent_s = ckpt.step, ckpt.state["train_seconds"]
        log(f"resumed from {ckpt.path} at step {step}")
    t0 = time.perf_counter()

    def train_seconds() -> float:
        return spent_s + time.perf_counter() - t0

    def take_step() -> dict[str, Any]:
        nonlocal step
        # the schedule follows whichever budget ends first: steps or seconds
        progress = max(step / cfg.steps, train_seconds() / cfg.time_limit_s)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        pick = torch.randint(len(train_data), (cfg.batch_sequences,), generator=gen)
        tokens = train_data[pick]
        summaries, logp = big_targets(big, draft, tokens)
        T = tokens.shape[1]
        starts = torch.randint(P - 1, T - k - 1, (len(tokens), cfg.starts_per_sequence), generator=gen)
        feats, toks, lp = rows(tokens, summaries, logp, starts, k)
        kl, neg_log_alpha = step_losses(draft.unroll(toks, draft.features(feats)), lp)
        w = {"kl": 0.0, "alpha": 1.0, "blend": min(1.0, progress)}[cfg.objective]
        loss = (1 - w) * kl.mean() + w * neg_log_alpha.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        record = {
            "step": step + 1,
            "loss": loss.item(),
            "kl": kl.mean().item(),
            "neg_log_alpha": neg_log_alpha.mean().item(),
        }
        if not cfg.progress and step % LOG_EVERY == 0:
            losses = f"KL {record['kl']:.3f}  -log alpha {record['neg_log_alpha']:.3f}"
            log(f"step {step:4d}  {losses}  ({train_seconds():.0f} s)")
        step += 1
        return record

    def save() -> None:
        state = {"position": step, "args": asdict(cfg), "train_seconds": train_seconds()}
        extra = {"rng.batches": gen.get_state()}
        folder.save(step, draft, opt, big.config, state, extra)

    def shown(record: dict[str, Any]) -> dict[str, str]:
        return {"kl": f"{record['kl']:.3f}", "-log_alpha": f"{record['neg_log_alpha']:.3f}"}

    folder.train(step, take_step, save, shown, stop=lambda: train_seconds() >= cfg.time_limit_s)
    draft.eval()
    report = evaluate(big, draft, eval_data, P)
    last = folder.summary(step)
    report.update(
        steps=step,
        train_seconds=round(train_seconds(), 1),
        config=asdict(cfg),
        final_kl=last.get("kl"),
        final_neg_log_alpha=last.get("neg_log_alpha"),
    )
    save_draft(draft, big, folder.path, training=report)
    return draft, report
