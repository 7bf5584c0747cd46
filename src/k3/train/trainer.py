"""The training loop (SPEC §4): Muon + AdamW, router-bias balancing between steps, gradient
accumulation, warmup + cosine/WSD schedule, clipping, periodic validation, a metrics log, atomic
checkpoints and exact resume.

A run lives in one folder: tokenizer.json, the packed token streams (*.npy), metrics.jsonl and
step_XXXXXXXX/ checkpoints. `--resume` continues from the newest checkpoint, under the configuration it
recorded, and produces the same losses as an unbroken run (bitwise on CPU). `--init-from` starts a new
run from the weights, config and tokenizer of a run, step or model folder (k3.hub loads it) instead of a
preset's random init.
"""

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from k3.config import K3Config
from k3.model import K3Model
from k3.train.balance import FixedStepBalancer, QuantileBalancer
from k3.train.checkpoint import CheckpointError, config_diff, load_checkpoint, save_checkpoint, step_dirs
from k3.train.corpus import load_corpus
from k3.train.data import PackedSequences, cached_pack
from k3.train.optim import build_optimizer, lr_at, set_lr_factor
from k3.train.tokenizer import K3Tokenizer, train_tokenizer

TOKENIZER_SAMPLE_BYTES = 8_000_000  # BPE merges are learned from about this much of the training text


@dataclass
class TrainArgs:
    out: str
    preset: str = "small"
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    schedule: str = "cosine"
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 100
    keep_last: int = 3
    seed: int = 0
    balancer: str = "quantile"
    qb_bins: int = 1000
    qb_exact_cutoff: bool = False
    data: str | None = None
    vocab_size: int = 8192
    resume: bool = False
    init_from: str | None = None
    text_only: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "ckpt_every", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"--schedule must be cosine or wsd, got {self.schedule!r}")
        if self.balancer not in ("quantile", "fixed", "none"):
            raise ValueError(f"--balancer must be quantile, fixed or none, got {self.balancer!r}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def prepare_tokenizer(run: Path, docs, vocab_size: int) -> K3Tokenizer:
    path = run / "tokenizer.json"
    if path.exists():
        return K3Tokenizer.load(path)
    # Learn merges from an evenly spaced sample of the training files, so every directory is represented.
    stride = max(1, int(sum(len(d.text) for d in docs) / TOKENIZER_SAMPLE_BYTES))
    tok = train_tokenizer([d.text for d in docs[::stride]], vocab_size)
    tok.save(path)
    return tok


class Trainer:
    def __init__(self, args: TrainArgs, log=print):
        self.args, self.log = args, log
        self.run = Path(args.out)
        self.run.mkdir(parents=True, exist_ok=True)
        self.device = device()
        ckpt = None
        if args.resume:
            if not step_dirs(self.run):
                raise CheckpointError(f"--resume: {self.run} has no checkpoint to resume from")
            ckpt = load_checkpoint(self.run)
        elif step_dirs(self.run):
            raise CheckpointError(f"{self.run} already holds checkpoints: pass --resume, or choose a new --out")

        pretrained = None
        if args.init_from is not None and ckpt is None:
            pretrained = self._init_source(args.init_from, args.text_only)
        train_docs, val_docs = load_corpus(args.data)
        self.tokenizer = prepare_tokenizer(self.run, train_docs, args.vocab_size)
        self.train_data = PackedSequences(cached_pack(self.run / "train_tokens.npy", train_docs, self.tokenizer),
                                          args.seq_len, args.seed)  # fmt: skip
        val = PackedSequences(cached_pack(self.run / "val_tokens.npy", val_docs, self.tokenizer), args.seq_len)
        self.val_batches = val.fixed_batches(args.eval_batches, args.batch_size)

        if pretrained is not None:
            self.config = pretrained.config
        elif ckpt is not None:
            self.config = self._resumed_config(ckpt)
        else:
            self.config = K3Config.from_preset(args.preset, vocab_size=self.tokenizer.vocab_size)
        torch.manual_seed(args.seed)
        self.model = (K3Model(self.config) if pretrained is None else pretrained.model.train()).to(self.device)
        self.optimizer = build_optimizer(self.model, lr=args.lr, weight_decay=args.weight_decay)
        self.balancer = None
        if args.balancer == "quantile":
            self.balancer = QuantileBalancer(self.model, num_bins=args.qb_bins, exact_cutoff=args.qb_exact_cutoff)
        elif args.balancer == "fixed":
            self.balancer = FixedStepBalancer(self.model)
        self.step, self.position = 0, 0
        if ckpt is not None:
            self._restore(ckpt)

    def _resumed_config(self, ckpt) -> K3Config:
        """--resume continues the model its run folder recorded, under that configuration.

        The flags that choose a configuration are --preset (by name) and --vocab-size (through the run's
        tokenizer, which a resumed run reuses). When the preset named now is the one the run started with,
        a difference between the recorded config and what that preset gives today comes from k3's
        defaults changing (rms_norm_eps 1e-6 -> 1e-5), not from the user: the recorded config is kept and
        the difference logged; only the vocabulary must match the tokenizer. Another preset, or a run that
        did not record one, is compared field by field as a request for that model, and refused if it
        differs. A run started from --init-from has no preset: its checkpoint's config is the model's."""
        recorded = ckpt.config
        if self.args.init_from is not None:
            return recorded
        now = K3Config.from_preset(self.args.preset, vocab_size=self.tokenizer.vocab_size)
        started = ckpt.state.get("args", {}).get("preset") or ckpt.state.get("init", {}).get("preset")
        diff = config_diff(recorded, now)
        if started != self.args.preset:
            if diff:
                raise CheckpointError(f"{ckpt.path} was trained with another configuration: " + "; ".join(diff))
            return recorded
        if recorded.vocab_size != self.tokenizer.vocab_size:
            raise CheckpointError(f"{ckpt.path} has a vocabulary of {recorded.vocab_size} tokens, the run's "
                                  f"tokenizer.json {self.tokenizer.vocab_size}: it was replaced")  # fmt: skip
        if diff:
            self.log(f"resuming with the configuration {ckpt.path} recorded; the {self.args.preset} preset now "
                     f"differs (recorded != now): " + "; ".join(diff))  # fmt: skip
        return recorded

    def _init_source(self, path: str, text_only: bool):
        """--init-from: weights, config and tokenizer of a run, step or model folder; the tokenizer is copied
        into the run so the corpus is tokenised the way the weights expect."""
        from k3.hub import load_pretrained

        pretrained = load_pretrained(path, text_only=text_only)
        if pretrained.tokenizer_path is None:
            raise CheckpointError(f"--init-from {path}: no tokenizer.json beside the weights; training needs the "
                                  f"tokenizer the model was trained with")  # fmt: skip
        if K3Tokenizer.load(pretrained.tokenizer_path).vocab_size > pretrained.config.vocab_size:
            raise CheckpointError(f"--init-from {path}: its tokenizer has more tokens than its model's vocabulary")
        source = pretrained.tokenizer_path.read_bytes()
        own = self.run / "tokenizer.json"
        if own.exists() and own.read_bytes() != source:
            raise CheckpointError(f"{own} differs from the tokenizer of --init-from {path}; choose a new --out")
        own.write_bytes(source)
        # The run trains dense weights: a release's quantization_config describes packed experts, not these.
        pretrained.config = replace(pretrained.config, quantization_config=None)
        pretrained.model.config = pretrained.config
        self.log(f"initialised from {pretrained.path} ({pretrained.kind}); its config and tokenizer replace "
                 f"--preset and --vocab-size")  # fmt: skip
        return pretrained

    def _restore(self, ckpt) -> None:
        ckpt.load_model(self.model)
        ckpt.load_optimizer(self.optimizer, self.model)
        extra = ckpt.tensors("extra.safetensors")
        torch.set_rng_state(extra["rng.torch"])
        if self.balancer is not None:
            self.balancer.load_state_dict(ckpt.state.get("balancer", {}))
        self.step, self.position = ckpt.step, ckpt.state["position"]
        # Drop metrics the interrupted run logged after this checkpoint: they are about to be redone.
        metrics = self.run / "metrics.jsonl"
        if metrics.exists():
            kept = [line for line in metrics.read_text().splitlines() if json.loads(line).get("step", 0) <= self.step]
            metrics.write_text("".join(line + "\n" for line in kept))
        self.log(f"resumed from {ckpt.path} at step {self.step}")

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # CPU: fp32 (bf16 matmul is far slower on CPUs without AMX)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        for batch in self.val_batches:
            batch = batch.to(self.device)
            with self.autocast():
                losses.append(self.model(batch, labels=batch).loss.item())
        self.model.train()
        return sum(losses) / len(losses)

    def save(self) -> Path:
        state = {"position": self.position, "args": asdict(self.args), "tokenizer": "tokenizer.json",
                 "balancer": self.balancer.state_dict() if self.balancer is not None else {}}  # fmt: skip
        return save_checkpoint(self.run, self.step, self.model, self.optimizer, self.config, state,
                               keep_last=self.args.keep_last)  # fmt: skip

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.run / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def train(self) -> dict[str, Any]:
        a = self.args
        tokens_per_step = a.batch_size * a.seq_len * a.grad_accum
        self.model.train()
        bar = tqdm(total=a.steps, initial=self.step, disable=not a.progress, unit="step", dynamic_ncols=True)
        last: dict[str, Any] = {}
        while self.step < a.steps:
            t0 = time.perf_counter()
            factor = lr_at(self.step, a.steps, min(a.warmup, a.steps), a.schedule, a.min_lr_ratio)
            set_lr_factor(self.optimizer, factor)
            loss_sum = 0.0
            for _ in range(a.grad_accum):
                batch = self.train_data.batch(self.position, a.batch_size).to(self.device)
                self.position += a.batch_size
                with self.autocast():
                    out = self.model(batch, labels=batch)
                (out.loss / a.grad_accum).backward()
                loss_sum += out.loss.item()
                if self.balancer is not None:
                    self.balancer.observe(out.routing)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.clip).item()
            maxvio = None
            if self.balancer is not None:
                maxvio = self.balancer.update()  # from this step's routing, applied from the next step
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            dt = time.perf_counter() - t0
            record = {"step": self.step, "loss": loss_sum / a.grad_accum, "lr": a.lr * factor,
                      "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / dt, "step_s": dt}  # fmt: skip
            if maxvio is not None:
                record["maxvio"] = maxvio
            if self.step % a.eval_every == 0 or self.step == a.steps:
                record["val_loss"] = self.evaluate()
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"step {self.step}: loss is {record['loss']}; lower --lr or check the data")
            self._write(record)
            last.update(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                            **({"val": f"{last['val_loss']:.3f}"} if "val_loss" in last else {}))  # fmt: skip
            if self.step % a.ckpt_every == 0 or self.step == a.steps:
                self.save()
        bar.close()
        return last
