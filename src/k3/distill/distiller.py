"""The distillation loop: the student continues domain prompts with the engine (on-policy), each sample is
scored by the teacher that owns its domain, and the student takes a Muon + AdamW step on the mean
per-token reverse KL (k3.distill.loss) over the sampled tokens, the full vocabulary at each position.

One step: (1) every --refresh-every steps the sampler takes the student's current weights; (2) the rows'
domains are drawn from the mixture and a prompt from each domain, all from random.Random seeded by
(seed, step, row); (3) the engine samples a continuation per prompt; (4) prompt + continuation, padded
to the longest row, go through the student (with gradients) and through each row's teacher (without);
(5) the KL at the positions that predict the continuation's tokens, averaged over them all, is the loss.
`--objective sft` is the baseline the evaluation compares with: cross-entropy on the document's own
continuation of the same prompts (no teacher, no sampling), the same steps and tokens.

The output folder is a run folder (k3.formats.run_folder: run.json, tokenizer.json, metrics.jsonl, step_*/
checkpoints) that k3 generate, k3 eval, k3 export, k3 train --init-from and another k3 distill --student
read. --resume continues from its newest checkpoint, with the flags run.json recorded (others are refused
unless --override), and reproduces the losses of an unbroken run: the sampler's weights are those of the
checkpoint's step when it refreshed then, and otherwise are saved beside it (extra.safetensors).
"""

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from k3.data.domains import DOMAINS, DomainError, parse_domains
from k3.distill.loss import reverse_kl
from k3.distill.prompts import DomainPrompts, Prompt
from k3.distill.sampler import OnPolicySampler
from k3.distill.teachers import TeacherError, TeacherSpec, load_teacher, route
from k3.formats.checkpoint import CheckpointError
from k3.formats.files import atomic_write
from k3.formats.run_args import RunArgs, arg
from k3.formats.run_folder import TOKENIZER, RunFolder
from k3.formats.run_record import RunRecord
from k3.formats.tokenizer import K3Tokenizer
from k3.model import K3Model
from k3.train.balance import QuantileBalancer
from k3.train.corpus import load_corpus
from k3.train.optim import SCHEDULES, build_optimizer, hyperparameters_kept, lr_at, set_lr_factor
from k3.train.trainer import device

OBJECTIVES = ("reverse-kl", "sft")
SAMPLER_PREFIX = "sampler/"  # the sampler's weights in extra.safetensors when they are not the checkpoint's own


@dataclass(kw_only=True)
class DistillArgs(RunArgs):
    """`k3 distill`'s flags (the run folder's own, from RunArgs, first); run.json records all but those."""

    out: str = arg(help="the run folder: run.json, tokenizer.json, metrics.jsonl, step_*/ checkpoints", recorded=False)
    steps: int = arg(100, "optimiser steps in all (with --resume: raise it to continue a finished run)", recorded=False)
    seed: int = arg(0, "seed of the domain draws, prompts and samples")
    ckpt_every: int = arg(50, "steps between checkpoints (the last step is always saved)", recorded=False)
    student: str = arg(help="the student to start from: a run, step or model folder", path=True)
    teacher: list[str] | None = arg(
        None,
        "NAME=CKPT, repeatable: the teacher of a domain (NAME: a domain, domains joined with +, or all)",
        metavar="NAME=CKPT",
    )
    mix: str | None = arg(None, "domain weights DOMAIN=W,... (default: every domain a teacher owns, equally)")
    objective: str = arg(
        "reverse-kl",
        "reverse-kl (on-policy distillation) or sft (the baseline: cross-entropy on the documents' own "
        "continuations, no teacher)",
        choices=OBJECTIVES,
    )
    batch_size: int = arg(8, "samples (prompts) per step")
    prompt_tokens: int = arg(32, "tokens of a corpus domain's prompt (a reasoning prompt is its question)")
    max_new_tokens: int = arg(48, "tokens sampled per prompt at most")
    temperature: float = arg(1.0, "the sampling temperature of the student's continuations")
    refresh_every: int = arg(1, "steps between loading the student's current weights into the sampler")
    lr: float = arg(1e-3, "peak learning rate")
    min_lr_ratio: float = arg(0.1, "final lr as a fraction of the peak")
    warmup: int = arg(5, "linear warmup steps")
    schedule: str = arg("cosine", "lr decay after warmup: cosine or wsd", choices=SCHEDULES)
    weight_decay: float = arg(0.1, "decoupled weight decay of the matrices")
    clip: float = arg(1.0, "gradient-norm clipping threshold")

    def __post_init__(self) -> None:
        self.teacher = list(self.teacher or [])
        super().__post_init__()
        self.at_least(1, "batch_size", "prompt_tokens", "max_new_tokens", "refresh_every")
        self.at_least(0, "warmup", "weight_decay")
        if not (self.lr > 0 and self.clip > 0 and self.temperature > 0):
            raise ValueError(
                f"--lr, --clip and --temperature must be positive, got {self.lr}, {self.clip}, {self.temperature}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be between 0 and 1, got {self.min_lr_ratio}")
        if self.objective == "reverse-kl" and not self.teacher:
            raise TeacherError("k3 distill needs at least one --teacher NAME=CKPT (or --objective sft)")
        self.mixture()  # parses --teacher and --mix

    def teachers(self) -> list[TeacherSpec]:
        return [TeacherSpec.parse(t) for t in self.teacher]

    def mixture(self) -> dict[str, float]:
        """domain -> weight; with teachers, every domain in it must have one."""
        owner = route(self.teachers())
        if self.mix is None:
            if not owner:
                raise ValueError("--objective sft without a teacher needs --mix DOMAIN=W,...")
            return {d: 1.0 for d in DOMAINS if d in owner}
        weights: dict[str, float] = {}
        for item in self.mix.split(","):
            name, sep, value = item.partition("=")
            try:
                (domain,) = parse_domains(name)
                weight = float(value) if sep else math.nan
            except (DomainError, ValueError):
                raise ValueError(
                    f"--mix {self.mix!r}: {item!r} is not DOMAIN=WEIGHT (domains: {', '.join(DOMAINS)})"
                ) from None
            if not weight > 0 or not math.isfinite(weight) or domain in weights:
                raise ValueError(f"--mix {self.mix!r}: {item!r}: each domain once, with a positive weight")
            weights[domain] = weight
        missing = [d for d in weights if d not in owner]
        if self.objective == "reverse-kl" and missing:
            raise TeacherError(f"--mix draws from {', '.join(missing)}, which no --teacher owns")
        return weights

    def recorded(self) -> dict[str, Any]:
        """What run.json records (RunArgs.recorded), each teacher's path made absolute."""
        values = super().recorded()
        values["teacher"] = [f"{'+'.join(s.domains)}={Path(s.path).resolve()}" for s in self.teachers()]
        return values


def _seed(*parts: int) -> int:
    return random.Random(":".join(map(str, parts))).getrandbits(63)


class Distiller:
    def __init__(self, args: DistillArgs, log=print):
        self.args, self.log = args, log
        self.mixture = args.mixture()
        self.folder = folder = RunFolder(args, log)
        if not Path(args.student).exists():
            raise FileNotFoundError(f"--student {args.student}: no such checkpoint, run or model folder")
        ckpt = folder.resume_from()
        now = RunRecord(args.recorded(), None, None, folder.tokenizer_sha256(), [])
        # a run folder from before run.json: its checkpoints recorded the settings as state["distill"]
        legacy = RunRecord(ckpt.state["distill"], None, None, None, []) if ckpt and "distill" in ckpt.state else None
        folder.reconcile(now, ckpt, legacy)  # reads only: a mismatch leaves no files
        if ckpt is not None:
            self.model = K3Model(ckpt.config).to(device())
            ckpt.load_model(self.model)
            tokenizer_path = folder.path / TOKENIZER
        else:
            from k3.hub import load_pretrained

            pretrained = load_pretrained(args.student, device=device())
            if pretrained.tokenizer_path is None:
                raise CheckpointError(f"--student {args.student}: no tokenizer.json beside the weights")
            self.model, tokenizer_path = pretrained.model, pretrained.tokenizer_path
        self.config = self.model.config
        self.model.train()
        tokenizer_bytes = tokenizer_path.read_bytes()
        self.tokenizer = K3Tokenizer.load(tokenizer_path)
        specs = args.teachers() if args.objective == "reverse-kl" else []  # SFT reads no teacher
        self.teachers = [load_teacher(s, tokenizer_bytes, self.config.vocab_size, device()) for s in specs]
        self.owner = route(specs)
        self.prompts = {
            d: DomainPrompts(d, load_corpus(d, log=log)[0], self.tokenizer, args.prompt_tokens, args.max_new_tokens)
            for d in self.mixture
        }
        self.optimizer = build_optimizer(self.model, lr=args.lr, weight_decay=args.weight_decay)
        self.balancer = QuantileBalancer(self.model)
        self.sampler = None
        if args.objective == "reverse-kl":
            self.sampler = OnPolicySampler(self.model, self.tokenizer, args.max_new_tokens, args.temperature)
        self.step = 0
        folder.open()  # everything above only read: a mistake leaves no files
        if ckpt is None:
            atomic_write(folder.path / TOKENIZER, tokenizer_bytes)
        folder.record_tokenizer()
        if ckpt is not None:
            self._restore(ckpt)

    def _restore(self, ckpt) -> None:
        with hyperparameters_kept(self.optimizer):
            ckpt.load_optimizer(self.optimizer, self.model)
        self.balancer.load_state_dict(ckpt.state.get("balancer", {}))
        self.step = ckpt.step
        sampler_step = ckpt.state.get("sampler_step")
        if self.sampler is not None and sampler_step is not None:
            if sampler_step == ckpt.step:
                self.sampler.refresh(self.model, sampler_step)
            else:
                extra = ckpt.tensors("extra.safetensors")
                weights = {k[len(SAMPLER_PREFIX) :]: v for k, v in extra.items() if k.startswith(SAMPLER_PREFIX)}
                self.sampler.model.load_state_dict(weights)
                self.sampler.weights_step = sampler_step
        self.log(f"resumed from {ckpt.path} at step {self.step}")

    def save(self) -> Path:
        sampler_step = None if self.sampler is None else self.sampler.weights_step
        state = {
            "position": self.step,
            "tokenizer": TOKENIZER,
            "args": asdict(self.args),
            "sampler_step": sampler_step,
            "balancer": self.balancer.state_dict(),
        }
        extra = None
        if sampler_step is not None and sampler_step != self.step:
            extra = {SAMPLER_PREFIX + k: v for k, v in self.sampler.model.state_dict().items()}
        return self.folder.save(self.step, self.model, self.optimizer, self.config, state, extra)

    def draw(self, step: int) -> list[Prompt]:
        """The step's prompts: each row's domain from the mixture, then a prompt of that domain."""
        a = self.args
        domains = random.Random(_seed(a.seed, step)).choices(
            list(self.mixture), list(self.mixture.values()), k=a.batch_size
        )
        return [self.prompts[d].draw(random.Random(_seed(a.seed, step, i))) for i, d in enumerate(domains)]

    def continuations(self, step: int, prompts: list[Prompt]) -> list[list[int]]:
        if self.sampler is None:
            return [p.reference for p in prompts]
        if self.sampler.weights_step is None or step % self.args.refresh_every == 0:
            self.sampler.refresh(self.model, step)
        seeds = [_seed(self.args.seed, step, i, 1) for i in range(len(prompts))]
        return self.sampler.sample([p.ids for p in prompts], seeds)

    def teacher_logits(self, batch_BT: torch.Tensor, domains: list[str], where_BT: torch.Tensor) -> torch.Tensor:
        """Each row through the teacher of its domain; the logits at `where_BT` in row order, (N, V)."""
        out = torch.empty(int(where_BT.sum()), self.config.vocab_size, device=batch_BT.device)
        first = torch.cumsum(where_BT.sum(1), 0) - where_BT.sum(1)  # each row's offset in the flattened positions
        for index, teacher in enumerate(self.teachers):
            rows = [i for i, d in enumerate(domains) if self.owner[d] == index]
            if not rows:
                continue
            with torch.no_grad():
                logits_RTV = teacher(batch_BT[rows]).logits
            for r, i in enumerate(rows):
                n = int(where_BT[i].sum())
                out[first[i] : first[i] + n] = logits_RTV[r][where_BT[i]].float()
        return out

    def _step(self) -> dict[str, Any]:
        a = self.args
        t0 = time.perf_counter()
        set_lr_factor(
            self.optimizer, factor := lr_at(self.step, a.steps, min(a.warmup, a.steps), a.schedule, a.min_lr_ratio)
        )
        prompts = self.draw(self.step)
        completions = self.continuations(self.step, prompts)
        sample_s = time.perf_counter() - t0
        rows = [p.ids + c for p, c in zip(prompts, completions, strict=True)]
        T = max(map(len, rows))
        batch_BT = torch.full((len(rows), T), self.tokenizer.eos_id, dtype=torch.long)
        where_BT = torch.zeros(len(rows), T, dtype=torch.bool)  # positions whose next token was continued
        for i, (p, row) in enumerate(zip(prompts, rows, strict=True)):
            batch_BT[i, : len(row)] = torch.tensor(row)
            where_BT[i, len(p.ids) - 1 : len(row) - 1] = True
        batch_BT, where_BT = batch_BT.to(device()), where_BT.to(device())
        out = self.model(batch_BT)
        student_NV = out.logits[where_BT]
        if self.sampler is None:
            targets_N = batch_BT[:, 1:][where_BT[:, :-1]]
            per_token = F.cross_entropy(student_NV.float(), targets_N, reduction="none")
        else:
            per_token = reverse_kl(student_NV, self.teacher_logits(batch_BT, [p.domain for p in prompts], where_BT))
        per_token.mean().backward()
        self.balancer.observe(out.routing)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.clip).item()
        self.balancer.update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        row_of_N = torch.arange(len(rows), device=where_BT.device).repeat_interleave(where_BT.sum(1))
        record = {
            "step": self.step,
            "loss": per_token.mean().item(),
            "lr": a.lr * factor,
            "grad_norm": grad_norm,
            "tokens": len(per_token),
            "sample_s": sample_s,
            "step_s": time.perf_counter() - t0,
        }
        if self.sampler is not None:
            record["sampler_step"] = self.sampler.weights_step
        for domain in self.mixture:
            picked = torch.tensor([p.domain == domain for p in prompts], device=row_of_N.device)[row_of_N]
            if picked.any():
                record[f"loss/{domain}"] = per_token[picked].mean().item()
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"step {self.step}: loss is {record['loss']}; lower --lr")
        return record

    def metrics(self) -> list[dict[str, Any]]:
        return self.folder.metrics(self.step)

    def train(self) -> dict[str, Any]:
        """Distil up to --steps; returns the last record (per-domain losses as last logged)."""

        def shown(record: dict[str, Any]) -> dict[str, str]:
            by_domain = {k.split("/", 1)[1]: f"{v:.2f}" for k, v in record.items() if k.startswith("loss/")}
            return {"loss": f"{record['loss']:.3f}", **by_domain}

        self.folder.train(self.step, self._step, self.save, shown)
        return self.folder.summary(self.step)
