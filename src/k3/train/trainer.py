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
import math
import time
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from k3.config import EXPERT_QUANTIZATIONS, PRESETS, K3Config
from k3.data.synthetic import MIX_TASKS, TASKS, SyntheticMix
from k3.formats.checkpoint import CheckpointError, config_diff
from k3.formats.files import atomic_write
from k3.formats.run_args import RunArgs, arg
from k3.formats.run_folder import TOKENIZER, RunFolder
from k3.formats.run_record import RunRecord
from k3.formats.tokenizer import K3Tokenizer, train_tokenizer
from k3.model import K3Model
from k3.model.quantization import set_expert_quantization
from k3.ops.compute_dtype import CHOICES as DTYPE_CHOICES
from k3.ops.compute_dtype import DtypeChoice, resolve_dtype
from k3.train.balance import BALANCERS, FixedStepBalancer, LoadMeter, QuantileBalancer, moe_routers
from k3.train.compiled import IdleExperts, compile_training, setup_blocker
from k3.train.corpus import data_entry, domain_spec, fingerprint, load_corpus
from k3.train.data import PackedSequences, cached_pack
from k3.train.distributed import DP_MODES, Parallel, kill_point
from k3.train.muon import NS_DTYPES
from k3.train.optim import EXPERT_OPTIMIZERS, SCHEDULES, build_optimizer, hyperparameters_kept, lr_at, set_lr_factor
from k3.train.parallelize import clip_grad_norm, parallelize, sync_expert_grads
from k3.train.stages import TrainBatches, parse_stages, stage_rows

TOKENIZER_SAMPLE_BYTES = 8_000_000  # BPE merges are learned from about this much of the training text
CACHED = ("train_tokens.npy", "val_tokens.npy")  # what the data and the tokenizer determine
# What each cached file is made from: an --override of one of these removes it (k3.formats.run_folder).
TOKENIZER_INPUTS = {"--data", "--vocab-size", "--init-from", "tokenizer.json"}
DERIVED = {TOKENIZER: TOKENIZER_INPUTS, **{n: {*TOKENIZER_INPUTS, "--val-data", "--val-fraction"} for n in CACHED}}


@dataclass(kw_only=True)
class TrainArgs(RunArgs):
    """`k3 train`'s flags (the run folder's own, from RunArgs, first). Recorded in run.json: what changes the
    result; --vocab-size, --init-from and --text-only choose the model itself."""

    out: str = arg(help="the run folder: run.json, tokenizer.json, tokens, metrics.jsonl, step_*/", recorded=False)
    steps: int = arg(
        200, "optimiser steps in all (with --resume: raise it to train a finished run longer)", recorded=False
    )
    preset: str = arg("small", f"model configuration, one of {', '.join(sorted(PRESETS))}", choices=sorted(PRESETS))
    batch_size: int = arg(8, "sequences per micro-batch")
    seq_len: int = arg(256, "tokens per sequence")
    grad_accum: int = arg(1, "micro-batches per optimiser step")
    lr: float = arg(3e-3, "peak learning rate (Muon and AdamW alike)")
    min_lr_ratio: float = arg(0.1, "final lr as a fraction of the peak")
    warmup: int = arg(20, "linear warmup steps")
    schedule: str = arg("cosine", "lr decay after warmup: cosine or wsd", choices=SCHEDULES)
    weight_decay: float = arg(0.1, "decoupled weight decay of the matrices")
    expert_optimizer: str = arg(
        "muon",
        "the routed experts' optimiser: muon, muon-active (no Newton-Schulz for experts without tokens this "
        "step) or adamw",
        choices=EXPERT_OPTIMIZERS,
    )
    expert_ns_steps: int = arg(5, "Newton-Schulz steps for the routed experts under muon / muon-active")
    muon_dtype: str = arg(
        "float32",
        "the dtype of Muon's Newton-Schulz iterations: float32, or bfloat16 (a faster optimiser step where bf16 "
        "matmuls are fast; measured 0.04-0.06 higher validation loss after 150 small-preset steps)",
        choices=tuple(NS_DTYPES),
    )
    dtype: str | None = arg(
        None,
        "the compute dtype: float32, bfloat16 (autocast: bf16 matmuls; fp32 master weights, optimiser state, "
        "norms and reductions) or auto (bf16 where this machine's bf16 matmul measures >= 1.5x fp32, or a CUDA "
        "device supports it) (default: float32 on a CPU, bfloat16 on CUDA)",
        metavar="{" + ",".join(DTYPE_CHOICES) + "}",
    )
    compile: bool = arg(
        False,
        "compile the training step with torch.compile (the CPU, one process): the same losses within fp32 "
        "rounding, a faster step after ~40 s of tracing (~150 s the first time on a machine: Inductor's code is "
        "cached in $K3_CACHE_DIR/inductor)",
    )
    clip: float = arg(1.0, "gradient-norm clipping threshold")
    eval_every: int = arg(50, "steps between validation-loss evaluations", recorded=False)
    eval_batches: int = arg(4, "validation batches per evaluation")
    balancer: str = arg("quantile", "router-bias balancing: quantile, fixed or none", choices=BALANCERS)
    qb_bins: int = arg(1000, "histogram bins per MoE layer of Quantile Balancing")
    qb_exact_cutoff: bool = arg(False, "Quantile Balancing with the k-th score as the cutoff for unpicked experts")
    data: str | None = arg(
        None,
        "a folder of text files, one text file, or a domain (code, tests, docs, reasoning-low, reasoning-high; "
        "join with +) (default: the Python standard library)",
        recorded=False,  # run.json records the data by path and content (data_entry)
    )
    val_data: str | None = arg(
        None, "validation text, a folder or a file (default: a --val-fraction of --data)", recorded=False
    )
    val_fraction: float = arg(0.02, "the fraction of --data's files held out for validation (by a hash of names)")
    vocab_size: int = arg(8192, "tokens of the byte-level BPE learned from the data", model=True)
    init_from: str | None = arg(
        None, "start from the weights, config and tokenizer of a run, step or model folder", model=True, path=True
    )
    text_only: bool = arg(False, "with --init-from: a multimodal model folder's language model only", model=True)
    tensorboard: bool = arg(False, "also log to <out>/tensorboard/ (needs the tensorboard package)", recorded=False)
    stages: str | None = arg(
        None,
        "staged context extension LENGTH:STEPS,... (e.g. 256:100,1024:50): each stage's sequence length, the "
        "same tokens per micro-batch; the last stage runs on to --steps",
    )
    synthetic_ratio: float = arg(
        0.0,
        "fraction of training sequences replaced by synthetic long-range tasks (k3.data.synthetic) of the "
        "sequence's length",
    )
    synthetic_tasks: str = arg(
        ",".join(MIX_TASKS),
        f"with --synthetic-ratio: the tasks mixed in, comma-separated, from {', '.join(TASKS)} (mqar: multi-query "
        "associative recall with as many bindings as fit)",
    )
    activation_checkpointing: bool = arg(
        False,
        "recompute each sublayer's activations in the backward: less memory, one more forward; same results",
        recorded=False,
    )
    qat: str | None = arg(
        None,
        "quantisation-aware training: mxfp4 (routed experts' weights MXFP4, their inputs MXFP8, straight-through "
        "gradients; the model's config records it, and the packed export computes exactly the trained function)",
    )
    dp: str = arg(
        "ddp",
        "with several processes: the non-expert parameters replicated (ddp) or sharded (fsdp)",
        choices=DP_MODES,
        recorded=False,
    )
    ep: int = arg(1, "with several processes: split the routed experts over groups of this many ranks", recorded=False)

    @property
    def synthetic_task_list(self) -> tuple[str, ...]:
        """--synthetic-tasks as a tuple of task names."""
        return tuple(t.strip() for t in self.synthetic_tasks.split(",") if t.strip())

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r} is not a preset; choose one of {', '.join(sorted(PRESETS))}")
        super().__post_init__()
        self.at_least(1, "batch_size", "seq_len", "grad_accum", "eval_every", "eval_batches", "vocab_size", "qb_bins")
        self.at_least(1, "expert_ns_steps", "ep")
        self.at_least(0, "warmup", "weight_decay")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if not self.clip > 0:
            raise ValueError(f"--clip must be positive, got {self.clip}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be between 0 and 1, got {self.min_lr_ratio}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be between 0 and 1 (exclusive), got {self.val_fraction}")
        if self.dtype is not None and self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.qat not in EXPERT_QUANTIZATIONS:
            raise ValueError(f"--qat must be mxfp4 (or absent: full precision), got {self.qat!r}")
        if self.stages is not None:
            parse_stages(self.stages)
        if not 0 <= self.synthetic_ratio <= 1:
            raise ValueError(f"--synthetic-ratio must be between 0 and 1, got {self.synthetic_ratio}")
        tasks = self.synthetic_task_list
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks or len(set(tasks)) != len(tasks):
            raise ValueError(
                f"--synthetic-tasks {self.synthetic_tasks!r}: name each task once, from {', '.join(TASKS)}"
            )
        if self.synthetic_ratio == 0 and tasks != MIX_TASKS:
            raise ValueError("--synthetic-tasks chooses what --synthetic-ratio mixes in; there is no --synthetic-ratio")
        if self.text_only and self.init_from is None:
            raise ValueError("--text-only applies to --init-from; there is no --init-from")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def prepare_tokenizer(run: Path, docs, vocab_size: int) -> K3Tokenizer:
    path = run / TOKENIZER
    if path.exists():
        return K3Tokenizer.load(path)
    # Learn merges from an evenly spaced sample of the training files, so every directory is represented.
    stride = max(1, int(sum(len(d.text) for d in docs) / TOKENIZER_SAMPLE_BYTES))
    tok = train_tokenizer([d.text for d in docs[::stride]], vocab_size)
    tok.save(path)
    return tok


def _check_inputs(args: TrainArgs) -> None:
    """The paths the run reads, and the packages it needs, checked before any work."""
    for flag, value in (("--data", args.data), ("--val-data", args.val_data)):
        if value is not None and not Path(value).exists() and domain_spec(value) is None:
            raise FileNotFoundError(f"{flag} {value}: no such file or directory")
    if args.init_from is not None and not Path(args.init_from).exists():
        raise FileNotFoundError(f"--init-from {args.init_from}: no such checkpoint, run or model folder")
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
        self.folder = folder = RunFolder(args, log, main)
        _check_inputs(args)
        if args.compile and (reason := setup_blocker(self.device, parallel.world_size, args.qat)) is not None:
            raise ValueError(f"--compile: {reason}")
        if args.batch_size % parallel.world_size:
            raise ValueError(
                f"--batch-size {args.batch_size} must be a multiple of the number of processes "
                f"({parallel.world_size}): each takes an equal share of every micro-batch"
            )
        for stage in parse_stages(args.stages) if args.stages else []:  # refused now, not hours in at that stage
            rows = stage_rows(args.batch_size, args.seq_len, stage.seq_len)
            if rows % parallel.world_size:
                raise ValueError(
                    f"--stages: the stage of {stage.seq_len} tokens has {rows} rows per micro-batch, "
                    f"which do not split over {parallel.world_size} processes; raise --batch-size"
                )
        if not main:
            parallel.barrier()  # rank 0 prepares the folder first
        ckpt = folder.resume_from()
        train_docs, val_docs = load_corpus(args.data, args.val_fraction, args.val_data, log=log)
        folder.reconcile(self._asked(train_docs, val_docs), ckpt, self._legacy(ckpt), DERIVED)
        if ckpt is not None:  # reads only so far: a mismatch leaves no files
            self._check_resumed(ckpt)
        folder.open()
        if hasattr(log, "attach"):  # a per-rank log file (k3.train.distributed.RankLog)
            log.attach(folder.path)
        pretrained = None
        if args.init_from is not None and ckpt is None:
            pretrained = self._init_source(args.init_from, args.text_only)
            self.config = pretrained.config
        if ckpt is None:
            self.tokenizer = prepare_tokenizer(folder.path, train_docs, args.vocab_size)
        folder.record_tokenizer()
        self.train_data = self._sequences("train", train_docs, args.seed)
        mix = None
        if args.synthetic_ratio > 0:
            mix = SyntheticMix(self.tokenizer, args.synthetic_ratio, args.seed, args.synthetic_task_list)
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
        self.forward = self.pm.forward  # what a training micro-batch runs: the model, its DDP wrapper, or compiled
        self.idle_experts = None
        if args.compile:
            self.forward = compile_training(self.model, parallel.world_size, log)
            self.idle_experts = IdleExperts(self.model)
            log("--compile: the first step traces and compiles the model (~40 s; ~150 s with a cold cache)")
        if args.dtype is not None or self.compute_dtype.dtype != torch.float32:
            log(f"compute dtype: {self.compute_dtype}")
        self.optimizer = self._optimizer(args.expert_optimizer, args.expert_ns_steps)
        self.balancer = None
        if args.balancer == "quantile":
            self.balancer = QuantileBalancer(self.model, num_bins=args.qb_bins, exact_cutoff=args.qb_exact_cutoff)
        elif args.balancer == "fixed":
            self.balancer = FixedStepBalancer(self.model)
        elif moe_routers(self.model):  # none: the bias is left as it is, MaxVio is still logged to compare
            self.balancer = LoadMeter(self.model)
        self.step, self.position = 0, 0
        if ckpt is not None:
            self._restore(ckpt)

    def _optimizer(self, expert_optimizer: str, expert_ns_steps: int):
        a = self.args
        return build_optimizer(
            self.model,
            lr=a.lr,
            weight_decay=a.weight_decay,
            expert_optimizer=expert_optimizer,
            expert_ns_steps=expert_ns_steps,
            ns_dtype=a.muon_dtype,
        )

    def _sequences(self, split: str, docs, seed: int) -> PackedSequences:
        tokens = cached_pack(self.folder.path / f"{split}_tokens.npy", docs, self.tokenizer)
        if len(tokens) < self.args.seq_len:
            what = "training" if split == "train" else "validation"
            raise ValueError(
                f"the {what} text is {len(tokens)} tokens, less than one sequence of --seq-len "
                f"{self.args.seq_len}; give more text (or --val-data / a larger --val-fraction) or a "
                f"smaller --seq-len"
            )
        return PackedSequences(tokens, self.args.seq_len, seed)

    @cached_property
    def device(self) -> torch.device:  # asked per micro-batch: CUDA's availability checked once
        return device()

    def _asked(self, train_docs, val_docs) -> RunRecord:
        """run.json as this run asks it: the flags, the data by path and content, the tokenizer already there."""
        a = self.args
        if a.val_data is None:
            data, val_data = data_entry(a.data, fingerprint(train_docs + val_docs)), None
        else:
            data, val_data = data_entry(a.data, fingerprint(train_docs)), data_entry(a.val_data, fingerprint(val_docs))
        return RunRecord(a.recorded(), data, val_data, self.folder.tokenizer_sha256(), [])

    def _legacy(self, ckpt) -> RunRecord | None:
        """What a run folder from before run.json recorded: its checkpoint's flags and data path."""
        old = ckpt.state.get("args") if ckpt is not None else None
        if not isinstance(old, dict):
            return None
        flags = {k: old[k] for k in self.args.recorded() if k in old}
        return RunRecord(flags, data_entry(old.get("data"), None), None, None, [])

    def _check_resumed(self, ckpt) -> None:
        """The optimiser layout the checkpoint was saved with, and a changed --steps said."""
        recorded = self.folder.recorded
        if recorded is not None:
            flags = recorded.flags
            self.saved_experts = (flags.get("expert_optimizer", "muon"), flags.get("expert_ns_steps", 5))
        recorded_steps = ckpt.state.get("args", {}).get("steps")
        if recorded_steps is not None and recorded_steps != self.args.steps:
            self.log(
                f"--steps: the run was started for {recorded_steps} steps, now {self.args.steps}; the lr schedule "
                f"is recomputed for {self.args.steps} from step {ckpt.step}"
            )
        tokenizer = self.folder.path / TOKENIZER  # the model to resume, checked against the run's tokenizer
        if not tokenizer.exists():
            raise CheckpointError(f"{tokenizer} is missing; the checkpoints of {self.folder.path} were trained with it")
        self.tokenizer = K3Tokenizer.load(tokenizer)
        self.config = self._resumed_config(ckpt)

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
        now = K3Config.from_preset(
            self.args.preset, vocab_size=self.tokenizer.vocab_size, expert_quantization=self.args.qat
        )
        started = ckpt.state.get("args", {}).get("preset") or ckpt.state.get("init", {}).get("preset")
        diff = config_diff(recorded, now)
        if started != self.args.preset:
            if diff:
                raise CheckpointError(f"{ckpt.path} was trained with another configuration: " + "; ".join(diff))
            return recorded
        if recorded.vocab_size != self.tokenizer.vocab_size:
            raise CheckpointError(
                f"{ckpt.path} has a vocabulary of {recorded.vocab_size} tokens, the run's "
                f"tokenizer.json {self.tokenizer.vocab_size}: it was replaced"
            )
        if diff:
            self.log(
                f"resuming with the configuration {ckpt.path} recorded; the {self.args.preset} preset now "
                f"differs (recorded != now): " + "; ".join(diff)
            )
        return recorded

    def _init_source(self, path: str, text_only: bool):
        """--init-from: weights, config and tokenizer of a run, step or model folder; the tokenizer is copied
        into the run so the corpus is tokenised the way the weights expect."""
        from k3.hub import load_pretrained

        pretrained = load_pretrained(path, text_only=text_only)
        if pretrained.tokenizer_path is None:
            raise CheckpointError(
                f"--init-from {path}: no tokenizer.json beside the weights; training needs the "
                f"tokenizer the model was trained with"
            )
        if K3Tokenizer.load(pretrained.tokenizer_path).vocab_size > pretrained.config.vocab_size:
            raise CheckpointError(f"--init-from {path}: its tokenizer has more tokens than its model's vocabulary")
        source = pretrained.tokenizer_path.read_bytes()
        own = self.folder.path / TOKENIZER
        if own.exists() and own.read_bytes() != source:
            raise CheckpointError(f"{own} differs from the tokenizer of --init-from {path}; choose a new --out")
        atomic_write(own, source)
        # The run trains dense weights: a release's quantization_config describes packed experts, not these.
        pretrained.config = replace(pretrained.config, quantization_config=None)
        pretrained.model.config = pretrained.config
        self.log(
            f"initialised from {pretrained.path} ({pretrained.kind}); its config and tokenizer replace "
            f"--preset and --vocab-size"
        )
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
        saved = getattr(self, "saved_experts", ("muon", 5))
        with hyperparameters_kept(self.optimizer):
            if saved == (self.args.expert_optimizer, self.args.expert_ns_steps):
                self._load_optimizer(ckpt, self.optimizer)
            else:  # --override changed the experts' optimiser: its groups differ from the checkpoint's
                self._carry_optimizer_state(ckpt, *saved)
        torch.set_rng_state(ckpt.tensors("extra.safetensors")["rng.torch"])
        if self.balancer is not None:
            self.balancer.load_state_dict(ckpt.state.get("balancer", {}))
        self.step, self.position = ckpt.step, ckpt.state["position"]
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
        self.log(
            f"--expert-optimizer {expert_optimizer} / --expert-ns-steps {expert_ns_steps} became "
            f"{self.args.expert_optimizer} / {self.args.expert_ns_steps}: optimiser state carried over where "
            f"the algorithm is the same; {fresh} parameters start theirs afresh"
        )

    @cached_property
    def compute_dtype(self) -> DtypeChoice:
        """--dtype resolved for this device: without it fp32 on a CPU (where bf16 can be far slower: measure it
        with --dtype auto) and bf16 on CUDA."""
        asked = self.args.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        return resolve_dtype(asked, self.device)

    def autocast(self):
        """bf16 autocast where the compute dtype is bf16: the matmuls in bf16 over fp32 weights, which stay the
        master copy (the optimiser and its state see fp32 only); norms, softmax and the loss in fp32."""
        if self.compute_dtype.dtype == torch.bfloat16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

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
        state = {
            "position": self.position,
            "args": asdict(self.args),
            "tokenizer": TOKENIZER,
            "balancer": self.balancer.state_dict() if self.balancer is not None else {},
        }
        if not self.parallel.distributed:
            return self.folder.save(self.step, self.model, self.optimizer, self.config, state)
        # every rank sends its part, rank 0 writes the single-process checkpoint, the others wait for it
        from k3.train.resharding import save_gathered

        a = self.args
        kill_point(self.parallel.rank, "checkpoint", self.step)
        experts = (a.expert_optimizer, a.expert_ns_steps)
        path = save_gathered(
            self.pm, self.optimizer, self.folder.path, self.step, self.config, state, *experts, a.keep_last
        )
        return self.folder.saved(self.step, path)

    def summary(self) -> dict[str, Any]:
        """The newest value of each metric the run logged (loss, val_loss, lr, ...), and the step."""
        summary = self.folder.summary(self.step)
        if "val_loss" not in summary:  # a finished run whose log was lost: measure instead of reporting nothing
            summary["val_loss"] = self.evaluate()
        return summary

    def train(self) -> dict[str, Any]:
        """Train up to --steps; returns summary(). A run already at --steps trains nothing and says so."""
        a = self.args
        if self.step >= a.steps:
            self.log(
                f"{self.folder.path} already finished {self.step} steps (--steps {a.steps}); nothing to train. "
                f"Give a larger --steps with --resume to train longer."
            )
            return self.summary()
        tokens_per_step = a.batch_size * a.seq_len * a.grad_accum
        self.model.train()
        board = None
        if a.tensorboard and self.parallel.is_main:
            from torch.utils.tensorboard import SummaryWriter

            board = SummaryWriter(log_dir=str(self.folder.path / "tensorboard"), purge_step=self.step + 1)
        last: dict[str, Any] = {}  # the newest value of each metric: the bar shows the last validation loss

        def take_step() -> dict[str, Any]:
            record = self._step(tokens_per_step)
            if board is not None:
                for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
                    if key in record:
                        board.add_scalar(key, record[key], self.step)
                for layer, value in enumerate(record.get("maxvio") or []):
                    board.add_scalar(f"maxvio/moe_layer_{layer + 1}", value, self.step)
            return record

        def shown(record: dict[str, Any]) -> dict[str, str]:
            last.update(record)
            val = {"val": f"{last['val_loss']:.3f}"} if "val_loss" in last else {}
            return {"loss": f"{record['loss']:.3f}", "tok_s": f"{record['tokens_per_s']:.0f}", **val}

        try:
            self.folder.train(self.step, take_step, self.save, shown)
        finally:
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
                out = self.forward(batch, labels=batch)
            (out.loss / a.grad_accum).backward()
            loss_sum += out.loss.item()
            if self.balancer is not None:
                self.balancer.observe(out.routing)
            if self.idle_experts is not None:
                self.idle_experts.observe(out.routing)
        if self.idle_experts is not None:
            self.idle_experts.release()
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
        record = {
            "step": self.step,
            "loss": loss_sum / a.grad_accum,
            "lr": a.lr * factor,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / dt,
            "step_s": dt,
        }
        if maxvio is not None:
            record["maxvio"] = maxvio
        if a.stages:
            record["seq_len"] = batch.shape[1]
        if self.step % a.eval_every == 0 or self.step == a.steps:
            record["val_loss"] = self.evaluate()
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"step {self.step}: loss is {record['loss']}; lower --lr or check the data")
        return record
