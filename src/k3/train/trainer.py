"""The training loop (SPEC §4): Muon + AdamW, router-bias balancing between steps, gradient
accumulation, warmup + cosine/WSD schedule, clipping, periodic validation, a metrics log, atomic
checkpoints and exact resume.

A run lives in one folder: run.json (what the run was made from: data, tokenizer, flags), tokenizer.json,
the packed token streams (*.npy), metrics.jsonl (appended to, one line per step) and step_XXXXXXXX/
checkpoints (by default only the newest, which is what a resume needs). `--resume` continues from the
newest checkpoint, under the configuration it recorded, and produces the same losses as an unbroken run
(bitwise on CPU). Any reuse of a folder is checked against run.json: other data, another tokenizer or a
changed flag is an error naming it, unless `--override` accepts the new values (then they take effect and
run.json records them). `--init-from` starts a new run from the weights, config and tokenizer of a run,
step or model folder (k3.hub loads it) instead of a preset's random init.

Every argument is checked before anything is written, so a mistake leaves no files behind.
"""

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from k3.config import PRESETS, K3Config
from k3.data.synthetic import SyntheticMix
from k3.formats.checkpoint import CheckpointError, config_diff, load_checkpoint, save_checkpoint, step_dirs
from k3.formats.files import (
    append_line,
    atomic_write,
    clean_stale_temp,
    latest_timeline,
    read_jsonl,
    repair_torn_tail,
)
from k3.formats.run_record import (
    RESULT_FLAGS,
    RunMismatchError,
    RunRecord,
    differences,
    file_sha256,
    model_differences,
    read_record,
    write_record,
)
from k3.formats.tokenizer import K3Tokenizer, train_tokenizer
from k3.model import K3Model
from k3.model.quantization import set_expert_quantization
from k3.train.balance import FixedStepBalancer, QuantileBalancer
from k3.train.corpus import data_entry, domain_spec, fingerprint, load_corpus
from k3.train.data import PackedSequences, cached_pack
from k3.train.distributed import DP_MODES, Parallel, kill_point
from k3.train.optim import EXPERT_OPTIMIZERS, build_optimizer, lr_at, set_lr_factor
from k3.train.parallelize import clip_grad_norm, parallelize, sync_expert_grads
from k3.train.stages import TrainBatches, parse_stages, stage_rows

TOKENIZER_SAMPLE_BYTES = 8_000_000  # BPE merges are learned from about this much of the training text
CACHED = ("train_tokens.npy", "val_tokens.npy")  # what the data and the tokenizer determine


def _arg(default, text: str):
    """A TrainArgs field whose help line the command line shows (with the default appended)."""
    return field(default=default, metadata={"help": text})


@dataclass
class TrainArgs:
    out: str = field(metadata={"help": "the run folder: run.json, tokenizer.json, tokens, metrics.jsonl, step_*/"})
    preset: str = _arg("small", f"model configuration, one of {', '.join(sorted(PRESETS))}")
    steps: int = _arg(200, "optimiser steps in all (with --resume: raise it to train a finished run longer)")
    batch_size: int = _arg(8, "sequences per micro-batch")
    seq_len: int = _arg(256, "tokens per sequence")
    grad_accum: int = _arg(1, "micro-batches per optimiser step")
    lr: float = _arg(3e-3, "peak learning rate (Muon and AdamW alike)")
    min_lr_ratio: float = _arg(0.1, "final lr as a fraction of the peak")
    warmup: int = _arg(20, "linear warmup steps")
    schedule: str = _arg("cosine", "lr decay after warmup: cosine or wsd")
    weight_decay: float = _arg(0.1, "decoupled weight decay of the matrices")
    expert_optimizer: str = _arg("muon", "the routed experts' optimiser: muon, muon-active (no Newton-Schulz for "
                                 "experts without tokens this step) or adamw")  # fmt: skip
    expert_ns_steps: int = _arg(5, "Newton-Schulz steps for the routed experts under muon / muon-active")
    clip: float = _arg(1.0, "gradient-norm clipping threshold")
    eval_every: int = _arg(50, "steps between validation-loss evaluations")
    eval_batches: int = _arg(4, "validation batches per evaluation")
    ckpt_every: int = _arg(100, "steps between checkpoints (the last step is always saved)")
    keep_last: int = _arg(1, "checkpoints kept (the newest, with optimiser state, is what --resume needs; 0 keeps all)")
    seed: int = _arg(0, "seed of the initialisation and of the data order")
    balancer: str = _arg("quantile", "router-bias balancing: quantile, fixed or none")
    qb_bins: int = _arg(1000, "histogram bins per MoE layer of Quantile Balancing")
    qb_exact_cutoff: bool = _arg(False, "Quantile Balancing with the k-th score as the cutoff for unpicked experts")
    data: str | None = _arg(None, "a folder of text files, one text file, or a domain (code, tests, docs, "
                            "reasoning-low, reasoning-high; join with +) (default: the Python standard "
                            "library)")  # fmt: skip
    val_data: str | None = _arg(None, "validation text, a folder or a file (default: a --val-fraction of --data)")
    val_fraction: float = _arg(0.02, "the fraction of --data's files held out for validation (by a hash of names)")
    vocab_size: int = _arg(8192, "tokens of the byte-level BPE learned from the data")
    resume: bool = _arg(False, "continue from the run folder's newest checkpoint")
    override: bool = _arg(False, "accept data or flags that differ from what the run folder recorded")
    init_from: str | None = _arg(None, "start from the weights, config and tokenizer of a run, step or model folder")
    text_only: bool = _arg(False, "with --init-from: a multimodal model folder's language model only")
    tensorboard: bool = _arg(False, "also log to <out>/tensorboard/ (needs the tensorboard package)")
    stages: str | None = _arg(
        None,
        "staged context extension LENGTH:STEPS,... (e.g. 256:100,1024:50): each stage's "
        "sequence length, the same tokens per micro-batch; the last stage runs on to --steps",
    )
    synthetic_ratio: float = _arg(
        0.0,
        "fraction of training sequences replaced by synthetic long-range tasks "
        "(k3.data.synthetic: retrieval, multihop, count) of the sequence's length",
    )
    activation_checkpointing: bool = _arg(
        False, "recompute each sublayer's activations in the backward: less memory, one more forward; same results"
    )
    qat: str | None = _arg(None, "quantisation-aware training: mxfp4 (routed experts' weights MXFP4, their inputs "
                           "MXFP8, straight-through gradients; the model's config records it, and the packed "
                           "export computes exactly the trained function)")  # fmt: skip
    dp: str = _arg("ddp", "with several processes: the non-expert parameters replicated (ddp) or sharded (fsdp)")
    ep: int = _arg(1, "with several processes: split the routed experts over groups of this many ranks")
    progress: bool = _arg(True, "show a progress bar")

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r} is not a preset; choose one of {', '.join(sorted(PRESETS))}")
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_batches", "ckpt_every",
                     "vocab_size", "qb_bins"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "keep_last", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(self, name)}")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"--schedule must be cosine or wsd, got {self.schedule!r}")
        if self.expert_optimizer not in EXPERT_OPTIMIZERS:
            raise ValueError(f"--expert-optimizer must be one of {', '.join(EXPERT_OPTIMIZERS)}, got "
                             f"{self.expert_optimizer!r}")  # fmt: skip
        if self.expert_ns_steps < 1:
            raise ValueError(f"--expert-ns-steps must be at least 1, got {self.expert_ns_steps}")
        if self.balancer not in ("quantile", "fixed", "none"):
            raise ValueError(f"--balancer must be quantile, fixed or none, got {self.balancer!r}")
        if self.dp not in DP_MODES:
            raise ValueError(f"--dp must be one of {', '.join(DP_MODES)}, got {self.dp!r}")
        if self.ep < 1:
            raise ValueError(f"--ep must be at least 1, got {self.ep}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if not self.clip > 0:
            raise ValueError(f"--clip must be positive, got {self.clip}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be between 0 and 1, got {self.min_lr_ratio}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be between 0 and 1 (exclusive), got {self.val_fraction}")
        if self.qat not in (None, "mxfp4"):
            raise ValueError(f"--qat must be mxfp4 (or absent: full precision), got {self.qat!r}")
        if self.stages is not None:
            parse_stages(self.stages)
        if not 0 <= self.synthetic_ratio <= 1:
            raise ValueError(f"--synthetic-ratio must be between 0 and 1, got {self.synthetic_ratio}")
        if self.text_only and self.init_from is None:
            raise ValueError("--text-only applies to --init-from; there is no --init-from")

    def flags(self) -> dict[str, Any]:
        """The flags run.json records (RESULT_FLAGS), paths made absolute."""
        values = {name: getattr(self, name) for name in RESULT_FLAGS}
        if values["init_from"] is not None:
            values["init_from"] = str(Path(values["init_from"]).resolve())
        return values


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


def _check_paths(args: TrainArgs) -> None:
    """What can be checked of the paths before any work: a mistake here leaves no files behind."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; a run folder is a directory (choose another --out)")
    for flag, value in (("--data", args.data), ("--val-data", args.val_data)):
        if value is not None and not Path(value).exists() and domain_spec(value) is None:
            raise FileNotFoundError(f"{flag} {value}: no such file or directory")
    if args.init_from is not None and not Path(args.init_from).exists():
        raise FileNotFoundError(f"--init-from {args.init_from}: no such checkpoint, run or model folder")
    has_checkpoints = out.is_dir() and bool(step_dirs(out))
    if args.resume and not has_checkpoints:
        raise CheckpointError(f"--resume: {out} has no checkpoint to resume from")
    if not args.resume and has_checkpoints:
        raise CheckpointError(f"{out} already holds checkpoints: pass --resume, or choose a new --out")
    if args.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--tensorboard needs the tensorboard package ({e}); pip install tensorboard") from e


class Trainer:
    """One process's trainer. With several (k3.train.distributed; `parallel`), rank 0 prepares the run folder
    (run.json, tokenizer, token streams) while the others wait, then they read it; every rank takes its rows
    of each micro-batch, and rank 0 alone writes metrics and checkpoints (k3.train.resharding)."""

    def __init__(self, args: TrainArgs, log=print, parallel: Parallel | None = None):
        self.args, self.log = args, log
        self.parallel = parallel = parallel or Parallel()
        main = parallel.is_main
        self.run = Path(args.out)
        _check_paths(args)
        if args.batch_size % parallel.world_size:
            raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the number of processes "
                             f"({parallel.world_size}): each takes an equal share of every micro-batch")  # fmt: skip
        for stage in parse_stages(args.stages) if args.stages else []:  # refused now, not hours in at that stage
            rows = stage_rows(args.batch_size, args.seq_len, stage.seq_len)
            if rows % parallel.world_size:
                raise ValueError(
                    f"--stages: the stage of {stage.seq_len} tokens has {rows} rows per micro-batch, "
                    f"which do not split over {parallel.world_size} processes; raise --batch-size"
                )
        if not main:
            parallel.barrier()  # rank 0 prepares the folder first
        ckpt = load_checkpoint(self.run, log=log) if args.resume else None
        train_docs, val_docs = load_corpus(args.data, args.val_fraction, args.val_data, log=log)
        record, stale = self._check_record(ckpt, train_docs, val_docs)  # reads only: a mismatch leaves no files
        if ckpt is not None:  # the model to resume, checked against the run's tokenizer before any write
            tokenizer = self.run / "tokenizer.json"
            if not tokenizer.exists():
                raise CheckpointError(f"{tokenizer} is missing; the checkpoints of {self.run} were trained with it")
            self.tokenizer = K3Tokenizer.load(tokenizer)
            self.config = self._resumed_config(ckpt)

        self.run.mkdir(parents=True, exist_ok=True)
        if hasattr(log, "attach"):  # a per-rank log file (k3.train.distributed.RankLog)
            log.attach(self.run)
        removed = clean_stale_temp(self.run) if main else []
        if removed:
            log(f"{self.run}: removed {len(removed)} unfinished writes of a killed run ({', '.join(removed[:3])})")
        torn = repair_torn_tail(self.run / "metrics.jsonl") if main else 0
        if torn:
            log(f"{self.run / 'metrics.jsonl'}: dropped a torn last line ({torn} bytes) left by an interrupted write")
        for name in stale:
            (self.run / name).unlink(missing_ok=True)
        if main:
            write_record(self.run, record)  # before the tokenizer: a kill during its training leaves a known folder

        pretrained = None
        if args.init_from is not None and ckpt is None:
            pretrained = self._init_source(args.init_from, args.text_only)
            self.config = pretrained.config
        if ckpt is None:
            self.tokenizer = prepare_tokenizer(self.run, train_docs, args.vocab_size)
        record.tokenizer_sha256 = file_sha256(self.run / "tokenizer.json")
        if main:
            write_record(self.run, record)
        self.train_data = self._sequences("train", train_docs, args.seed)
        mix = SyntheticMix(self.tokenizer, args.synthetic_ratio, args.seed) if args.synthetic_ratio > 0 else None
        stages = parse_stages(args.stages) if args.stages else None
        self.batches = TrainBatches(self.train_data, args.batch_size, stages, mix)
        val = self._sequences("val", val_docs, 0)
        self.val_batches = val.fixed_batches(args.eval_batches, args.batch_size)
        if main:
            parallel.barrier()  # the folder is ready for the other ranks
        if ckpt is None and pretrained is None:
            self.config = K3Config.from_preset(args.preset, vocab_size=self.tokenizer.vocab_size)
        torch.manual_seed(args.seed)
        self.model = (K3Model(self.config) if pretrained is None else pretrained.model.train()).to(self.device)
        self.config = set_expert_quantization(self.model, args.qat)  # --qat decides, whatever the source said
        self.model.set_activation_checkpointing(args.activation_checkpointing)
        if ckpt is not None and parallel.distributed:  # the full weights, before the model is split over ranks
            ckpt.load_model(self.model)
        self.pm = parallelize(self.model, parallel)
        self.optimizer = self._optimizer(args.expert_optimizer, args.expert_ns_steps)
        self.balancer = None
        if args.balancer == "quantile":
            self.balancer = QuantileBalancer(self.model, num_bins=args.qb_bins, exact_cutoff=args.qb_exact_cutoff)
        elif args.balancer == "fixed":
            self.balancer = FixedStepBalancer(self.model)
        self.step, self.position = 0, 0
        self.saved_step: int | None = None
        if ckpt is not None:
            self._restore(ckpt)

    def _optimizer(self, expert_optimizer: str, expert_ns_steps: int):
        a = self.args
        return build_optimizer(self.model, lr=a.lr, weight_decay=a.weight_decay, expert_optimizer=expert_optimizer,
                               expert_ns_steps=expert_ns_steps)  # fmt: skip

    def _sequences(self, split: str, docs, seed: int) -> PackedSequences:
        tokens = cached_pack(self.run / f"{split}_tokens.npy", docs, self.tokenizer)
        if len(tokens) < self.args.seq_len:
            what = "training" if split == "train" else "validation"
            raise ValueError(f"the {what} text is {len(tokens)} tokens, less than one sequence of --seq-len "
                             f"{self.args.seq_len}; give more text (or --val-data / a larger --val-fraction) or a "
                             f"smaller --seq-len")  # fmt: skip
        return PackedSequences(tokens, self.args.seq_len, seed)

    @cached_property
    def device(self) -> torch.device:  # asked per micro-batch: CUDA's availability checked once
        return device()

    def _check_record(self, ckpt, train_docs, val_docs) -> tuple[RunRecord, list[str]]:
        """(run.json as it will be written now, the cached files to remove first), after comparing what is
        asked with what the folder recorded. Writes nothing.

        A difference is a RunMismatchError naming each item, unless --override: then the new values take
        effect (cached files that depended on the old ones are removed) and the record lists what changed
        and from which step. With checkpoints, the flags that choose the model (MODEL_FLAGS) cannot change."""
        a = self.args
        if a.val_data is None:
            data = data_entry(a.data, fingerprint(train_docs + val_docs))
            val_data = None
        else:
            data, val_data = data_entry(a.data, fingerprint(train_docs)), data_entry(a.val_data, fingerprint(val_docs))
        tokenizer = self.run / "tokenizer.json"
        now = RunRecord(a.flags(), data, val_data, file_sha256(tokenizer) if tokenizer.exists() else None, [])
        recorded = read_record(self.run)
        if recorded is not None and ckpt is not None:  # the optimiser layout the checkpoint was saved with
            self.saved_experts = (recorded.flags.get("expert_optimizer", "muon"),
                                  recorded.flags.get("expert_ns_steps", 5))  # fmt: skip
        if recorded is None and ckpt is not None and isinstance(ckpt.state.get("args"), dict):
            # a run folder from before run.json: its checkpoint recorded the flags and the data path
            old = ckpt.state["args"]
            recorded = RunRecord({k: old[k] for k in RESULT_FLAGS if k in old}, data_entry(old.get("data"), None),
                                 None, None, [])  # fmt: skip
        if recorded is None:
            leftovers = [n for n in ("tokenizer.json", *CACHED, "metrics.jsonl") if (self.run / n).exists()]
            if ckpt is None and leftovers:
                if not a.override:
                    raise RunMismatchError(
                        f"{self.run} holds files of an earlier run that did not record what it was made from "
                        f"({', '.join(leftovers)}); pass --override to replace them, or choose a new --out"
                    )
                return now, leftovers
            return now, []
        diffs = differences(recorded, now)
        if ckpt is not None:
            fixed = model_differences(recorded, now)
            if fixed:
                raise RunMismatchError(f"{self.run}: " + "; ".join(fixed) + "; these cannot change on --resume "
                                       "(choose a new --out)")  # fmt: skip
            recorded_steps = ckpt.state.get("args", {}).get("steps")
            if recorded_steps is not None and recorded_steps != a.steps:
                self.log(f"--steps: the run was started for {recorded_steps} steps, now {a.steps}; the lr schedule "
                         f"is recomputed for {a.steps} from step {ckpt.step}")  # fmt: skip
        if not diffs:
            now.history = recorded.history
            return now, []
        if not a.override:
            raise RunMismatchError(
                f"{self.run} was made from other settings than these: " + "; ".join(diffs) + ". Pass --override "
                "to continue with the new values (run.json records them), or choose a new --out"
            )
        changed = {d.split(":", 1)[0] for d in diffs}
        data_changed = bool(changed & {"--data", "--val-data", "--val-fraction"})
        tokenizer_inputs = bool(changed & {"--data", "--vocab-size", "--init-from", "tokenizer.json"})
        stale = list(CACHED) if data_changed or tokenizer_inputs else []
        if ckpt is None and tokenizer_inputs:  # nothing trained depends on the tokenizer yet: learn it again
            stale.append("tokenizer.json")
        now.history = [*recorded.history, {"step": 0 if ckpt is None else ckpt.step, "override": diffs}]
        self.log(f"--override: continuing {self.run} with " + "; ".join(diffs))
        return now, stale

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
        now = K3Config.from_preset(self.args.preset, vocab_size=self.tokenizer.vocab_size,
                                   expert_quantization=self.args.qat)  # fmt: skip
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
        atomic_write(own, source)
        # The run trains dense weights: a release's quantization_config describes packed experts, not these.
        pretrained.config = replace(pretrained.config, quantization_config=None)
        pretrained.model.config = pretrained.config
        self.log(f"initialised from {pretrained.path} ({pretrained.kind}); its config and tokenizer replace "
                 f"--preset and --vocab-size")  # fmt: skip
        return pretrained

    def _load_optimizer(self, ckpt, optimizer) -> None:
        if not self.parallel.distributed:
            ckpt.load_optimizer(optimizer, self.model)
            return
        from k3.train.resharding import local_part

        ckpt.load_optimizer(optimizer, self.model, others_experts=self.parallel.ep > 1, place=local_part)

    def _restore(self, ckpt) -> None:
        if not self.parallel.distributed:  # (several ranks loaded the weights before splitting the model)
            ckpt.load_model(self.model)
        # The optimiser's saved groups carry the run's lr and weight decay; the flags given now are the ones
        # that count (equal unless --override accepted new values), so they are taken from the fresh groups.
        fresh = [(g["base_lr"], g["weight_decay"]) for g in self.optimizer.param_groups]
        saved = getattr(self, "saved_experts", ("muon", 5))
        if saved == (self.args.expert_optimizer, self.args.expert_ns_steps):
            self._load_optimizer(ckpt, self.optimizer)
        else:  # --override changed the experts' optimiser: its groups differ from the checkpoint's
            self._carry_optimizer_state(ckpt, *saved)
        for group, (lr, weight_decay) in zip(self.optimizer.param_groups, fresh, strict=True):
            group["base_lr"], group["weight_decay"] = lr, weight_decay
        extra = ckpt.tensors("extra.safetensors")
        torch.set_rng_state(extra["rng.torch"])
        if self.balancer is not None:
            self.balancer.load_state_dict(ckpt.state.get("balancer", {}))
        self.step, self.position = ckpt.step, ckpt.state["position"]
        self.saved_step = ckpt.step
        # metrics.jsonl is only appended to: the lines the interrupted run logged after this checkpoint are
        # superseded by the ones this run logs for the same steps (k3.formats.files.latest_timeline).
        self.log(f"resumed from {ckpt.path} at step {self.step}")

    def _carry_optimizer_state(self, ckpt, expert_optimizer: str, expert_ns_steps: int) -> None:
        """Load the checkpoint's optimiser state into the layout it was saved with, then give each parameter
        its state where its algorithm is unchanged (Muon momentum for muon <-> muon-active or new NS steps);
        a parameter that changed algorithm (the experts, muon <-> adamw) starts its new state from zero."""
        old = self._optimizer(expert_optimizer, expert_ns_steps)
        self._load_optimizer(ckpt, old)
        algo = {id(p): g["algo"] for g in old.param_groups for p in g["params"]}
        fresh = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if algo[id(p)] != group["algo"]:
                    fresh += 1
                elif p in old.state:  # (a parameter that never had a gradient has no state yet)
                    self.optimizer.state[p] = old.state[p]
        self.log(f"--expert-optimizer {expert_optimizer} / --expert-ns-steps {expert_ns_steps} became "
                 f"{self.args.expert_optimizer} / {self.args.expert_ns_steps}: optimiser state carried over where "
                 f"the algorithm is the same; {fresh} parameters start theirs afresh")  # fmt: skip

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # CPU: fp32 (bf16 matmul is far slower on CPUs without AMX)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        for batch in self.val_batches:
            split = len(batch) % self.parallel.world_size == 0  # else every rank evaluates the whole batch
            batch = (self.parallel.rows(batch) if split else batch).to(self.device)
            with self.autocast():
                loss = self.model(batch, labels=batch).loss.item()
            losses.append(self.parallel.mean(loss) if split else loss)
        self.model.train()
        return sum(losses) / len(losses)

    def save(self) -> Path:
        state = {"position": self.position, "args": asdict(self.args), "tokenizer": "tokenizer.json",
                 "balancer": self.balancer.state_dict() if self.balancer is not None else {}}  # fmt: skip
        a = self.args
        if not self.parallel.distributed:
            path = save_checkpoint(self.run, self.step, self.model, self.optimizer, self.config, state,
                                   keep_last=a.keep_last)  # fmt: skip
        else:  # every rank sends its part, rank 0 writes the single-process checkpoint, the others wait for it
            from k3.train.resharding import save_gathered

            kill_point(self.parallel.rank, "checkpoint", self.step)
            path = save_gathered(self.pm, self.optimizer, self.run, self.step, self.config, state, a.expert_optimizer,
                                 a.expert_ns_steps, a.keep_last)  # fmt: skip
        self.saved_step = self.step
        return path

    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl as the run went (a resumed run's lines replace the interrupted run's), up to now."""
        path = self.run / "metrics.jsonl"
        records = latest_timeline(read_jsonl(path, log=self.log)) if path.exists() else []
        return [r for r in records if r.get("step", 0) <= self.step]

    def summary(self) -> dict[str, Any]:
        """The newest value of each metric the run logged (loss, val_loss, lr, ...), and the step."""
        last: dict[str, Any] = {}
        for record in self.metrics():
            last.update(record)
        if "val_loss" not in last:  # a finished run whose log was lost: measure instead of reporting nothing
            last["val_loss"] = self.evaluate()
        return {**last, "step": self.step}

    def _tensorboard(self):
        if not self.args.tensorboard:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.run / "tensorboard"), purge_step=self.step + 1)

    def train(self) -> dict[str, Any]:
        """Train up to --steps; returns summary(). A run already at --steps trains nothing and says so."""
        a = self.args
        if self.step >= a.steps:
            self.log(f"{self.run} already finished {self.step} steps (--steps {a.steps}); nothing to train. "
                     f"Give a larger --steps with --resume to train longer.")  # fmt: skip
            return self.summary()
        tokens_per_step = a.batch_size * a.seq_len * a.grad_accum
        self.model.train()
        board = self._tensorboard()
        bar = tqdm(total=a.steps, initial=self.step, disable=not a.progress or not self.parallel.is_main, unit="step",
                   dynamic_ncols=True)  # fmt: skip
        last: dict[str, Any] = {}
        try:
            while self.step < a.steps:
                record = self._step(tokens_per_step)
                if not self.parallel.is_main:  # rank 0 keeps the run's log; the others note their steps
                    self.log(json.dumps(record))
                    if self.step % a.ckpt_every == 0 or self.step == a.steps:
                        self.save()
                    continue
                append_line(self.run / "metrics.jsonl", json.dumps(record))
                if board is not None:
                    for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
                        if key in record:
                            board.add_scalar(key, record[key], self.step)
                    for layer, value in enumerate(record.get("maxvio") or []):
                        board.add_scalar(f"maxvio/moe_layer_{layer + 1}", value, self.step)
                last.update(record)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                **({"val": f"{last['val_loss']:.3f}"} if "val_loss" in last else {}))  # fmt: skip
                if self.step % a.ckpt_every == 0 or self.step == a.steps:
                    self.save()
        finally:
            bar.close()
            if board is not None:
                board.close()
        return self.summary()

    def _step(self, tokens_per_step: int) -> dict[str, Any]:
        """One optimiser step; returns its metrics record."""
        a = self.args
        t0 = time.perf_counter()
        factor = lr_at(self.step, a.steps, min(a.warmup, a.steps), a.schedule, a.min_lr_ratio)
        set_lr_factor(self.optimizer, factor)
        loss_sum = 0.0
        for _ in range(a.grad_accum):
            batch = self.batches.batch(self.step, self.position)
            self.position += batch.shape[0]
            batch = self.parallel.rows(batch).to(self.device)  # this rank's rows only travel to the device
            with self.autocast():
                out = self.pm.forward(batch, labels=batch)
            (out.loss / a.grad_accum).backward()
            loss_sum += out.loss.item()
            if self.balancer is not None:
                self.balancer.observe(out.routing)
        kill_point(self.parallel.rank, "step", self.step + 1)
        sync_expert_grads(self.pm)
        grad_norm = clip_grad_norm(self.pm, a.clip)
        loss_sum = self.parallel.mean(loss_sum)
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
        if a.stages:
            record["seq_len"] = batch.shape[1]
        if self.step % a.eval_every == 0 or self.step == a.steps:
            record["val_loss"] = self.evaluate()
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"step {self.step}: loss is {record['loss']}; lower --lr or check the data")
        return record
