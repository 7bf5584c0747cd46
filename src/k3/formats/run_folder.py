"""A run folder's life, the same for every training loop (k3 train, the image-text trainer, k3 distill and
k3 train-draft), in the order a loop goes through it:

    folder = RunFolder(args, log)           # --out and --resume checked against the folder; reads only
    ckpt = folder.resume_from()             # the checkpoint --resume continues, None for a fresh run
    folder.reconcile(now, ckpt)             # run.json compared with what is asked now; reads only
    folder.open()                           # the first write: stale and temp files removed, run.json written
    folder.record_tokenizer()               # run.json takes the sha256 of the tokenizer.json just written
    folder.train(step, take_step, save)     # the steps: metrics.jsonl, the progress bar, --ckpt-every saves
    folder.save(step, model, optimizer, config, state)

What is asked is a `RunRecord` (k3.formats.run_record): the flags args.recorded() gives, the data, the
tokenizer's sha256. Reusing a folder (a resume, or a restart after an interruption before the first
checkpoint) with a difference is a RunMismatchError naming each item, unless --override: then the new values
take effect, the files that depended on the old ones are removed (`derived`), and run.json lists what changed
and from which step. Once a checkpoint exists, the flags that choose the model cannot change at all.

With several processes only the main one writes (run.json, metrics.jsonl, cleanup); the others log their
metrics through `log` and wait for the folder to be ready.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from k3.config import K3Config
from k3.formats.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint, step_dirs
from k3.formats.files import append_line, clean_stale_temp, latest_timeline, read_jsonl, repair_torn_tail
from k3.formats.run_args import RunArgs
from k3.formats.run_record import (
    RunMismatchError,
    RunRecord,
    differences,
    file_sha256,
    model_differences,
    read_record,
    write_record,
)

TOKENIZER = "tokenizer.json"
METRICS = "metrics.jsonl"


class RunFolder:
    """One run folder and the one owner of what is known about it: the checkpoint resumed, run.json as this
    run writes it, and the newest step saved."""

    def __init__(self, args: RunArgs, log: Callable[[str], None] = print, main: bool = True):
        self.args, self.log, self.main = args, log, main
        self.path = Path(args.out)
        self.resumed: Checkpoint | None = None  # the checkpoint --resume continues (resume_from)
        self.record: RunRecord | None = None  # run.json as this run writes it (reconcile)
        self.stale: list[str] = []  # the files reconcile found made from what --override changed; open removes them
        self.recorded: RunRecord | None = None  # run.json as an earlier run left it
        self.saved_step: int | None = None
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"--out {self.path} is a file; a run folder is a directory (choose another --out)")
        has_checkpoints = self.path.is_dir() and bool(step_dirs(self.path))
        if args.resume and not has_checkpoints:
            raise CheckpointError(f"--resume: {self.path} has no checkpoint to resume from")
        if not args.resume and has_checkpoints:
            raise CheckpointError(f"{self.path} already holds checkpoints: pass --resume, or choose a new --out")

    def resume_from(self) -> Checkpoint | None:
        """With --resume, the newest usable checkpoint (an older one when the newest is damaged, as
        load_checkpoint says through `log`); None for a fresh run."""
        if not self.args.resume:
            return None
        self.resumed = load_checkpoint(self.path, log=self.log)
        self.saved_step = self.resumed.step
        return self.resumed

    def reconcile(
        self,
        now: RunRecord,
        ckpt: Checkpoint | None,
        legacy: RunRecord | None = None,
        derived: dict[str, set[str]] | None = None,
    ) -> None:
        """Compare what is asked (`now`) with run.json; keep `now` (with the history of overrides) as the record
        open() writes, and the files open() removes first (`stale`). Writes nothing.

        legacy: what a checkpoint written before run.json existed records instead (a resume only).
        derived: file -> the items ("--data", "tokenizer.json") it was made from, so an --override of one of
        them removes it; tokenizer.json itself only while no checkpoint depends on it."""
        derived = derived or {}
        self.record = now
        self.recorded = read_record(self.path)
        recorded = self.recorded if self.recorded is not None or ckpt is None else legacy
        if recorded is None:
            leftovers = [n for n in dict.fromkeys((TOKENIZER, *derived, METRICS)) if (self.path / n).exists()]
            if ckpt is None and leftovers:
                if not self.args.override:
                    raise RunMismatchError(
                        f"{self.path} holds files of an earlier run that did not record what it was made from "
                        f"({', '.join(leftovers)}); pass --override to replace them, or choose a new --out"
                    )
                self.stale = leftovers
            return
        diffs = differences(recorded, now)
        if ckpt is not None:
            fixed = model_differences(recorded, now, self.args.model_flags())
            if fixed:
                raise RunMismatchError(
                    f"{self.path}: " + "; ".join(fixed) + "; these cannot change on --resume (choose a new --out)"
                )
        if not diffs:
            now.history = recorded.history
            return
        if not self.args.override:
            raise RunMismatchError(
                f"{self.path} was made from other settings than these: " + "; ".join(diffs) + ". Pass --override "
                "to continue with the new values (run.json records them), or choose a new --out"
            )
        now.history = [*recorded.history, {"step": 0 if ckpt is None else ckpt.step, "override": diffs}]
        self.log(f"--override: continuing {self.path} with " + "; ".join(diffs))
        changed = {d.split(":", 1)[0] for d in diffs}
        self.stale = [n for n, inputs in derived.items() if inputs & changed and (n != TOKENIZER or ckpt is None)]

    def open(self) -> None:
        """The run's first write: the folder made; on the main process the temporary files killed writes left
        and a torn last line of metrics.jsonl removed (and said), the stale files removed, run.json written."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.main:
            return
        removed = clean_stale_temp(self.path)
        if removed:
            self.log(
                f"{self.path}: removed {len(removed)} unfinished writes of a killed run ({', '.join(removed[:3])})"
            )
        torn = repair_torn_tail(self.path / METRICS)
        if torn:
            self.log(f"{self.path / METRICS}: dropped a torn last line ({torn} bytes) left by an interrupted write")
        for name in self.stale:
            (self.path / name).unlink(missing_ok=True)
        if self.record is not None:  # before the tokenizer: a kill while it is made leaves a known folder
            write_record(self.path, self.record)

    def record_tokenizer(self) -> None:
        """run.json takes the sha256 of the run's tokenizer.json, now that it is there."""
        self.record.tokenizer_sha256 = file_sha256(self.path / TOKENIZER)
        if self.main:
            write_record(self.path, self.record)

    def tokenizer_sha256(self) -> str | None:
        """The sha256 of the tokenizer.json already in the folder (None: there is none yet)."""
        path = self.path / TOKENIZER
        return file_sha256(path) if path.exists() else None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: K3Config,
        state: dict[str, Any],
        extra: dict[str, torch.Tensor] | None = None,
    ) -> Path:
        """step_XXXXXXXX/ (k3.formats.checkpoint), the newest --keep-last kept."""
        path = save_checkpoint(self.path, step, model, optimizer, config, state, extra, keep_last=self.args.keep_last)
        return self.saved(step, path)

    def saved(self, step: int, path: Path) -> Path:
        """Note a checkpoint of `step` written at `path` (by save, or by rank 0 gathering every rank's part)."""
        self.saved_step = step
        return path

    def newest_saved(self) -> int | None:
        """The newest step saved, on disk too: Ctrl-C can land after a checkpoint's folder is renamed into place
        but before save() returns."""
        on_disk = [int(p.name.rsplit("_", 1)[1]) for p in step_dirs(self.path)] if self.path.is_dir() else []
        return max([s for s in (self.saved_step, *on_disk) if s is not None], default=None)

    def log_metrics(self, record: dict[str, Any]) -> None:
        """One step's metrics: a fsynced line of metrics.jsonl (the main process), a line of `log` (the others)."""
        if self.main:
            append_line(self.path / METRICS, json.dumps(record))
        else:
            self.log(json.dumps(record))

    def metrics(self, up_to: int) -> list[dict[str, Any]]:
        """metrics.jsonl as the run went (a resumed run's lines replace the interrupted run's), to step `up_to`."""
        path = self.path / METRICS
        records = latest_timeline(read_jsonl(path, log=self.log)) if path.exists() else []
        return [r for r in records if r.get("step", 0) <= up_to]

    def summary(self, up_to: int) -> dict[str, Any]:
        """The newest value of each metric logged (loss, val_loss, lr, ...) to step `up_to`, and that step."""
        last: dict[str, Any] = {}
        for record in self.metrics(up_to):
            last.update(record)
        return {**last, "step": up_to}

    def train(
        self,
        step: int,
        take_step: Callable[[], dict[str, Any]],
        save: Callable[[], Any],
        shown: Callable[[dict[str, Any]], dict[str, str]] = lambda record: {},
        stop: Callable[[], bool] = lambda: False,
    ) -> int:
        """Steps from `step` until --steps (or `stop()`): each step's record (take_step's, with its "step")
        logged, a checkpoint every --ckpt-every steps and at the last step, a progress bar showing
        shown(record). Returns the step reached."""
        a = self.args
        shows = a.progress and self.main
        bar = tqdm(total=a.steps, initial=step, disable=not shows, unit="step", dynamic_ncols=True)
        try:
            while step < a.steps and not stop():
                record = take_step()
                step = record["step"]
                self.log_metrics(record)
                bar.update(1)
                bar.set_postfix(**shown(record))
                if step % a.ckpt_every == 0 or step == a.steps:
                    save()
            if step != self.saved_step and step > 0:  # stopped early (a time limit): the last step is saved too
                save()
        finally:
            bar.close()
        return step
