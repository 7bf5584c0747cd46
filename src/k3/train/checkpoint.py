"""Checkpoints: safetensors for every tensor, one small JSON for the rest, no pickle anywhere.

A checkpoint is a folder `step_XXXXXXXX/` holding
    model.safetensors      the model's state_dict under the released checkpoint's names
    optimizer.safetensors  optimiser state, keyed "<parameter name>::<state key>"
    extra.safetensors      RNG state and any other tensors the trainer keeps (balancer state)
    meta.json              step, config (official layout), training state, optimiser groups, and the
                           sha256 of each file above, so truncation or tampering is detected on load.
It is written to a hidden temporary folder, fsynced, then renamed into place: a crash mid-write
leaves the previous checkpoints intact and no half-written one that looks complete.

Checkpoints written before k3 used the released AttnRes names (`attention_res_*`, `ffn_res_*`) load with
their keys mapped by `k3.model.names.legacy_key`, model and optimiser alike, and one FutureWarning per
checkpoint (a warning users see by default, unlike DeprecationWarning) saying so.
"""

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.model.names import legacy_key

FORMAT = "k3-checkpoint-1"
FILES = ("model.safetensors", "optimizer.safetensors", "extra.safetensors")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, modified, or does not fit the model it is loaded into."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    dirs = [p for p in Path(run_dir).glob("step_*") if p.is_dir() and (p / "meta.json").exists()]
    return sorted(dirs, key=lambda p: p.name)


def _optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict, dict]:
    """Optimiser state keyed by parameter name (robust to parameter order), and its groups as JSON."""
    sd = optimizer.state_dict()
    flat_params = [p for group in optimizer.param_groups for p in group["params"]]
    index_to_name = {i: names[id(p)] for i, p in enumerate(flat_params)}
    tensors, scalars = {}, {}
    for i, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index_to_name[i]}::{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{index_to_name[i]}::{key}"] = value
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index_to_name[i] for i in g["params"]]}
              for g in sd["param_groups"]]  # fmt: skip
    return tensors, {"groups": groups, "scalars": scalars}


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: K3Config,
    state: dict[str, Any],
    extra: dict[str, torch.Tensor] | None = None,
    keep_last: int = 3,
) -> Path:
    """Write step `step` atomically and prune all but the newest `keep_last` checkpoints."""
    run_dir = Path(run_dir)
    final = run_dir / f"step_{step:08d}"
    tmp = run_dir / f".step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = {id(p): n for n, p in model.named_parameters()}
    model_tensors = {k: v.detach().contiguous().cpu().clone() for k, v in model.state_dict().items()}
    opt_tensors, opt_meta = _optimizer_tensors(optimizer, names)
    extra = {"rng.torch": torch.get_rng_state(), **(extra or {})}
    save_file(model_tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    save_file(opt_tensors, tmp / "optimizer.safetensors", metadata={"format": "pt"})
    save_file({k: v.contiguous().cpu() for k, v in extra.items()}, tmp / "extra.safetensors", metadata={"format": "pt"})
    meta = {
        "format": FORMAT,
        "step": step,
        "config": config.to_hf(),
        "state": state,
        "optimizer": opt_meta,
        "sha256": {f: _sha256(tmp / f) for f in FILES},
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for f in (*FILES, "meta.json"):
        _fsync(tmp / f)
    if final.exists():  # re-saving the same step: replace it
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync(run_dir)
    for old in step_dirs(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


@dataclass
class Checkpoint:
    path: Path
    meta: dict[str, Any]
    _warned_legacy: bool = field(default=False, repr=False, compare=False)

    @property
    def step(self) -> int:
        return self.meta["step"]

    @property
    def config(self) -> K3Config:
        return K3Config.from_hf(self.meta["config"])

    @property
    def state(self) -> dict[str, Any]:
        return self.meta["state"]

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        try:
            return load_file(self.path / name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{self.path / name}: cannot be read as safetensors ({e})") from e

    def _released_names(self, keys: list[str], what: str) -> dict[str, str]:
        """old key -> key under the released names, for `keys` of `what`; warns once per checkpoint if any
        key was written under k3's pre-release names."""
        renamed = {k: legacy_key(k) for k in keys}
        moved = sorted(k for k, new in renamed.items() if new != k)
        if not moved:
            return renamed
        clash = sorted(set(renamed[k] for k in moved) & set(keys))
        if clash:
            raise CheckpointError(f"{self.path}: {what} holds both the old and the released name of {clash[:3]}")
        if not self._warned_legacy:
            self._warned_legacy = True
            warnings.warn(
                f"{self.path} uses k3's pre-release AttnRes names ({moved[0]!r} and others); they were mapped to "
                "the released names (self_attention_res_*, mlp_res_*). Save it again to write the new names.",
                FutureWarning,
                stacklevel=3,
            )
        return renamed

    def load_model(self, model: torch.nn.Module) -> None:
        """Load the weights strictly: a key the model cannot place, or one it lacks, is an error."""
        tensors = self.tensors("model.safetensors")
        names = self._released_names(list(tensors), "model.safetensors")
        tensors = {names[k]: v for k, v in tensors.items()}
        own = model.state_dict()
        unexpected = sorted(set(tensors) - set(own))
        missing = sorted(set(own) - set(tensors))
        if unexpected or missing:
            raise CheckpointError(
                f"{self.path}: the checkpoint does not fit this model: unexpected keys {unexpected[:5]}"
                f"{'…' if len(unexpected) > 5 else ''}, missing keys {missing[:5]}{'…' if len(missing) > 5 else ''}"
            )
        for k, v in tensors.items():
            if v.shape != own[k].shape:
                raise CheckpointError(f"{self.path}: {k} has shape {list(v.shape)}, the model has {list(own[k].shape)}")
        model.load_state_dict(tensors, strict=True)

    def load_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        flat = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        index = {n: i for i, n in enumerate(flat)}
        saved = self.meta["optimizer"]
        new = self._released_names([n for g in saved["groups"] for n in g["params"]], "the optimiser's groups")
        saved_names = [new[n] for g in saved["groups"] for n in g["params"]]
        if saved_names != flat:
            raise CheckpointError(f"{self.path}: the optimiser's parameter groups differ from the checkpoint's")
        state: dict[int, dict[str, Any]] = {}
        for key, value in [*self.tensors("optimizer.safetensors").items(), *saved["scalars"].items()]:
            name, leaf = key.split("::")
            state.setdefault(index[legacy_key(name)], {})[leaf] = value
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[new[n]] for n in g["params"]]}
                  for g in saved["groups"]]  # fmt: skip
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def load_checkpoint(path: str | Path, verify: bool = True) -> Checkpoint:
    """A checkpoint folder, or a run folder (its newest complete checkpoint). Checks the format and,
    with verify, every file's sha256 against meta.json."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if not (path / "meta.json").exists():
        found = step_dirs(path)
        if not found:
            raise CheckpointError(f"{path}: no checkpoint here (no step_*/meta.json)")
        path = found[-1]
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'meta.json'} is not valid JSON (truncated or corrupted): {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} checkpoint (format = {meta.get('format')!r})")
    if verify:
        for f in FILES:
            if not (path / f).exists():
                raise CheckpointError(f"{path / f} is missing: the checkpoint is incomplete")
            if _sha256(path / f) != meta["sha256"].get(f):
                raise CheckpointError(f"{path / f} does not match the checksum in meta.json: truncated or modified")
    return Checkpoint(path, meta)


def config_diff(a: K3Config, b: K3Config) -> list[str]:
    """Fields where two configs differ, as 'name: a != b'."""
    da, db = a.to_dict(), b.to_dict()
    return [f"{k}: {da[k]!r} != {db[k]!r}" for k in da if k != "extra_hf" and da[k] != db[k]]
