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

The output folder is a run folder (tokenizer.json, metrics.jsonl, step_*/ checkpoints) that k3 generate,
k3 eval, k3 export, k3 train --init-from and another k3 distill --student read. --resume continues from its
newest checkpoint and reproduces the losses of an unbroken run: the sampler's weights are those of the
checkpoint's step when it refreshed then, and otherwise are saved beside it (extra.safetensors).
"""

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from k3.data.domains import DOMAINS, DomainError, parse_domains
from k3.distill.loss import reverse_kl
from k3.distill.prompts import DomainPrompts, Prompt
from k3.distill.sampler import OnPolicySampler
from k3.distill.teachers import TeacherError, TeacherSpec, load_teacher, route
from k3.formats.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, step_dirs
from k3.formats.files import append_line, atomic_write, clean_stale_temp, latest_timeline, read_jsonl, repair_torn_tail
from k3.formats.tokenizer import K3Tokenizer
from k3.model import K3Model
from k3.train.balance import QuantileBalancer
from k3.train.corpus import load_corpus
from k3.train.optim import build_optimizer, lr_at, set_lr_factor
from k3.train.trainer import (
    _arg,  # a flag field: its help is the CLI's
    device,
)

OBJECTIVES = ("reverse-kl", "sft")
SAMPLER_PREFIX = "sampler/"  # the sampler's weights in extra.safetensors when they are not the checkpoint's own
KEPT_AS_GIVEN = ("out", "steps", "ckpt_every", "keep_last", "resume", "progress")  # not compared on --resume


@dataclass
class DistillArgs:
    student: str = field(metadata={"help": "the student to start from: a run, step or model folder"})
    out: str = field(metadata={"help": "the folder to write: tokenizer.json, metrics.jsonl, step_*/ checkpoints"})
    teacher: list[str] | None = field(default=None, metadata={"help": "NAME=CKPT, repeatable: the teacher of a "
                                      "domain (NAME: a domain, domains joined with +, or all)"})  # fmt: skip
    mix: str | None = _arg(None, "domain weights DOMAIN=W,... (default: every domain a teacher owns, equally)")
    objective: str = _arg("reverse-kl", "reverse-kl (on-policy distillation) or sft (the baseline: cross-entropy "
                          "on the documents' own continuations, no teacher)")  # fmt: skip
    steps: int = _arg(100, "optimiser steps in all (with --resume: raise it to continue a finished run)")
    batch_size: int = _arg(8, "samples (prompts) per step")
    prompt_tokens: int = _arg(32, "tokens of a corpus domain's prompt (a reasoning prompt is its question)")
    max_new_tokens: int = _arg(48, "tokens sampled per prompt at most")
    temperature: float = _arg(1.0, "the sampling temperature of the student's continuations")
    refresh_every: int = _arg(1, "steps between loading the student's current weights into the sampler")
    lr: float = _arg(1e-3, "peak learning rate")
    min_lr_ratio: float = _arg(0.1, "final lr as a fraction of the peak")
    warmup: int = _arg(5, "linear warmup steps")
    schedule: str = _arg("cosine", "lr decay after warmup: cosine or wsd")
    weight_decay: float = _arg(0.1, "decoupled weight decay of the matrices")
    clip: float = _arg(1.0, "gradient-norm clipping threshold")
    seed: int = _arg(0, "seed of the domain draws, prompts and samples")
    ckpt_every: int = _arg(50, "steps between checkpoints (the last step is always saved)")
    keep_last: int = _arg(1, "checkpoints kept (0 keeps all)")
    resume: bool = _arg(False, "continue from --out's newest checkpoint")
    progress: bool = _arg(True, "show a progress bar")

    def __post_init__(self) -> None:
        self.teacher = list(self.teacher or [])
        for name in ("steps", "batch_size", "prompt_tokens", "max_new_tokens", "refresh_every", "ckpt_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "keep_last", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(self, name)}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"--schedule must be cosine or wsd, got {self.schedule!r}")
        if not (self.lr > 0 and self.clip > 0 and self.temperature > 0):
            raise ValueError(f"--lr, --clip and --temperature must be positive, got {self.lr}, {self.clip}, "
                             f"{self.temperature}")  # fmt: skip
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
                raise ValueError(f"--mix {self.mix!r}: {item!r} is not DOMAIN=WEIGHT (domains: "
                                 f"{', '.join(DOMAINS)})") from None  # fmt: skip
            if not weight > 0 or not math.isfinite(weight) or domain in weights:
                raise ValueError(f"--mix {self.mix!r}: {item!r}: each domain once, with a positive weight")
            weights[domain] = weight
        missing = [d for d in weights if d not in owner]
        if self.objective == "reverse-kl" and missing:
            raise TeacherError(f"--mix draws from {', '.join(missing)}, which no --teacher owns")
        return weights

    def recorded(self) -> dict[str, Any]:
        """What a resume must match: every flag but KEPT_AS_GIVEN, paths made absolute."""
        values = {k: v for k, v in asdict(self).items() if k not in KEPT_AS_GIVEN}
        values["student"] = str(Path(self.student).resolve())
        values["teacher"] = [f"{'+'.join(s.domains)}={Path(s.path).resolve()}" for s in self.teachers()]
        return values


def _seed(*parts: int) -> int:
    return random.Random(":".join(map(str, parts))).getrandbits(63)


class Distiller:
    def __init__(self, args: DistillArgs, log=print):
        self.args, self.log, self.run = args, log, Path(args.out)
        self.mixture = args.mixture()
        self._check_paths()
        ckpt = load_checkpoint(self.run, log=log) if args.resume else None
        if ckpt is not None:
            differ = [f"--{k.replace('_', '-')}: the run recorded {v!r}, now {args.recorded().get(k)!r}"
                      for k, v in ckpt.state.get("distill", {}).items() if args.recorded().get(k) != v]  # fmt: skip
            if differ:
                raise CheckpointError(f"{self.run} was distilled with other settings: " + "; ".join(differ)
                                      + ". Resume with the same flags, or choose a new --out")  # fmt: skip
            self.model = K3Model(ckpt.config).to(device())
            ckpt.load_model(self.model)
            tokenizer_path = self.run / "tokenizer.json"
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
        self.prompts = {d: DomainPrompts(d, load_corpus(d, log=log)[0], self.tokenizer, args.prompt_tokens,
                                         args.max_new_tokens) for d in self.mixture}  # fmt: skip
        self.optimizer = build_optimizer(self.model, lr=args.lr, weight_decay=args.weight_decay)
        self.balancer = QuantileBalancer(self.model)
        self.sampler = None
        if args.objective == "reverse-kl":
            self.sampler = OnPolicySampler(self.model, self.tokenizer, args.max_new_tokens, args.temperature)
        self.step, self.saved_step = 0, None
        self.run.mkdir(parents=True, exist_ok=True)  # everything above only read: a mistake leaves no files
        clean_stale_temp(self.run)
        repair_torn_tail(self.run / "metrics.jsonl")
        if ckpt is None:
            atomic_write(self.run / "tokenizer.json", tokenizer_bytes)
        else:
            self._restore(ckpt)

    def _check_paths(self) -> None:
        a = self.args
        if self.run.exists() and not self.run.is_dir():
            raise ValueError(f"--out {self.run} is a file; the output is a folder (choose another --out)")
        if not Path(a.student).exists():
            raise FileNotFoundError(f"--student {a.student}: no such checkpoint, run or model folder")
        has = self.run.is_dir() and bool(step_dirs(self.run))
        if a.resume and not has:
            raise CheckpointError(f"--resume: {self.run} has no checkpoint to resume from")
        if not a.resume and has:
            raise CheckpointError(f"{self.run} already holds checkpoints: pass --resume, or choose a new --out")

    def _restore(self, ckpt) -> None:
        ckpt.load_optimizer(self.optimizer, self.model)
        self.balancer.load_state_dict(ckpt.state.get("balancer", {}))
        self.step = self.saved_step = ckpt.step
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
        state = {"position": self.step, "tokenizer": "tokenizer.json", "distill": self.args.recorded(),
                 "sampler_step": sampler_step, "balancer": self.balancer.state_dict()}  # fmt: skip
        extra = None
        if sampler_step is not None and sampler_step != self.step:
            extra = {SAMPLER_PREFIX + k: v for k, v in self.sampler.model.state_dict().items()}
        path = save_checkpoint(self.run, self.step, self.model, self.optimizer, self.config, state, extra,
                               keep_last=self.args.keep_last)  # fmt: skip
        self.saved_step = self.step
        return path

    def draw(self, step: int) -> list[Prompt]:
        """The step's prompts: each row's domain from the mixture, then a prompt of that domain."""
        a = self.args
        domains = random.Random(_seed(a.seed, step)).choices(list(self.mixture), list(self.mixture.values()),
                                                             k=a.batch_size)  # fmt: skip
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
        set_lr_factor(self.optimizer, factor := lr_at(self.step, a.steps, min(a.warmup, a.steps), a.schedule,
                                                      a.min_lr_ratio))  # fmt: skip
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
        record = {"step": self.step, "loss": per_token.mean().item(), "lr": a.lr * factor, "grad_norm": grad_norm,
                  "tokens": len(per_token), "sample_s": sample_s, "step_s": time.perf_counter() - t0}  # fmt: skip
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
        path = self.run / "metrics.jsonl"
        if not path.exists():
            return []
        return [r for r in latest_timeline(read_jsonl(path, log=self.log)) if r["step"] <= self.step]

    def train(self) -> dict[str, Any]:
        """Distil up to --steps; returns the last record (per-domain losses as last logged)."""
        a = self.args
        bar = tqdm(total=a.steps, initial=self.step, disable=not a.progress, unit="step", dynamic_ncols=True)
        try:
            while self.step < a.steps:
                record = self._step()
                append_line(self.run / "metrics.jsonl", json.dumps(record))
                bar.update(1)
                by_domain = {k.split("/", 1)[1]: f"{v:.2f}" for k, v in record.items() if k.startswith("loss/")}
                bar.set_postfix(loss=f"{record['loss']:.3f}", **by_domain)
                if self.step % a.ckpt_every == 0 or self.step == a.steps:
                    self.save()
        finally:
            bar.close()
        last: dict[str, Any] = {}
        for record in self.metrics():
            last.update(record)
        return {**last, "step": self.step}
