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
"""

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from k3.model.generate import generate
from k3.model.model import K3Model
from k3.spec.draft import DEFAULT_NUM_SPECULATIVE_TOKENS, DraftModel
from k3.spec.features import block_summaries

OBJECTIVES = ("kl", "alpha", "blend")


@dataclass
class DraftTrainConfig:
    mode: str = "chain"
    objective: str = "alpha"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    steps: int = 300
    time_limit_s: float = 240.0  # stop after this many seconds of training, whatever `steps`
    lr: float = 2e-3
    batch_sequences: int = 4  # continuations per step
    starts_per_sequence: int = 24  # start positions t drawn from each
    prompt_tokens: int = 32
    new_tokens: int = 64
    train_sequences: int = 96
    eval_sequences: int = 24
    temperature: float = 0.0  # of the big model's continuations
    seed: int = 0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.new_tokens <= self.num_speculative_tokens + 1:
            raise ValueError(f"new_tokens ({self.new_tokens}) must exceed num_speculative_tokens + 1")


@torch.no_grad()
def continuations(big: K3Model, corpus: np.ndarray, n: int, cfg: DraftTrainConfig, seed: int,
                  batch: int = 32) -> torch.Tensor:  # fmt: skip
    """n prompts of cfg.prompt_tokens tokens drawn from the corpus, each continued by the big model for
    cfg.new_tokens tokens -> (n, prompt_tokens + new_tokens) token ids."""
    P = cfg.prompt_tokens
    if len(corpus) < P + 1:
        raise ValueError(f"the corpus has {len(corpus)} tokens; need more than {P}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(corpus) - P, size=n)
    prompts = torch.from_numpy(np.stack([corpus[s : s + P] for s in starts]).astype(np.int64))
    out = [generate(big, prompts[i : i + batch], cfg.new_tokens, temperature=cfg.temperature, seed=seed + i)
           for i in range(0, n, batch)]  # fmt: skip
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
    return {"tokens_per_step_greedy": greedy_len, "tokens_per_step_sampled": sampled_len,
            "greedy_acceptance_at": accepted_at, "alpha_at": alpha.mean(0).tolist(), "rows": len(match)}  # fmt: skip


def train_draft(big: K3Model, train_data: torch.Tensor, eval_data: torch.Tensor, cfg: DraftTrainConfig,
                log=print) -> tuple[DraftModel, dict]:  # fmt: skip
    """Train a draft against the frozen big model on its continuations -> (draft, report)."""
    torch.manual_seed(cfg.seed)
    for p in big.parameters():
        p.requires_grad_(False)
    big.eval()
    draft = DraftModel(big.config, cfg.mode, cfg.num_speculative_tokens).attach(big)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.0)
    k, P = cfg.num_speculative_tokens, cfg.prompt_tokens
    gen = torch.Generator().manual_seed(cfg.seed)
    t0, step, history = time.perf_counter(), 0, []
    while step < cfg.steps and time.perf_counter() - t0 < cfg.time_limit_s:
        # the schedule follows whichever budget ends first: steps or seconds
        progress = max(step / cfg.steps, (time.perf_counter() - t0) / cfg.time_limit_s)
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
        history.append({"step": step, "kl": kl.mean().item(), "neg_log_alpha": neg_log_alpha.mean().item()})
        if step % 20 == 0:
            log(f"step {step:4d}  KL {kl.mean().item():.3f}  -log alpha {neg_log_alpha.mean().item():.3f}  "
                f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        step += 1
    draft.eval()
    report = evaluate(big, draft, eval_data, P)
    report.update(steps=step, train_seconds=round(time.perf_counter() - t0, 1), config=asdict(cfg),
                  final_kl=history[-1]["kl"] if history else None,
                  final_neg_log_alpha=history[-1]["neg_log_alpha"] if history else None)  # fmt: skip
    return draft, report
