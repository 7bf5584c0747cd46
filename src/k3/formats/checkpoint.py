"""Checkpoints: safetensors for every tensor, one small JSON for the rest, no pickle anywhere.

A checkpoint is a folder `step_XXXXXXXX/` holding
    model.safetensors      the model's state_dict under the released checkpoint's names
    optimizer.safetensors  optimiser state, keyed "<parameter name>::<state key>"
    extra.safetensors      RNG state and any other tensors the trainer keeps (balancer state)
    meta.json              step, config (official layout), training state, optimiser groups, the
                           sha256 of each file above, and `meta_sha256`, the sha256 of meta.json's own
                           content, so truncation, tampering or a hand edit of any file is detected on load.
It is written to a hidden temporary folder, fsynced, then renamed into place: a crash mid-write
leaves the previous checkpoints intact and no half-written one that looks complete.

Loading a run folder takes its newest checkpoint; when that one is incomplete or damaged it falls back to
the next older one and says which it used and why (through `log`, by default a CheckpointWarning), so a
damaged newest checkpoint costs the steps since the older one, not the run. meta.json of the wrong shape
(a list, a string step, no position, no checksums) is a CheckpointError naming the field, as is a
tokenizer path in the training state that leads outside the run folder.

Checkpoints written before k3 used the released AttnRes names (`attention_res_*`, `ffn_res_*`) load with
their keys mapped by `k3.model.names.legacy_key`, model and optimiser alike, and one FutureWarning per
checkpoint (a warning users see by default, unlike DeprecationWarning) saying so.
"""

import hashlib
import json
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.formats.files import fsync_path
from k3.model.names import legacy_key

FORMAT = "k3-checkpoint-2"  # -2 added meta_sha256; -1 (no self-checksum) still loads
READABLE_FORMATS = ("k3-checkpoint-1", FORMAT)
FILES = ("model.safetensors", "optimizer.safetensors", "extra.safetensors")
STEP_NAME = re.compile(r"step_\d{8}")
ROUTED_EXPERT = re.compile(r".*\.block_sparse_moe\.experts\.\d+\..*")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, modified, or does not fit the model it is loaded into."""


class CheckpointWarning(UserWarning):
    """A run folder's newest checkpoint could not be used and an older one was."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def meta_checksum(meta: dict[str, Any]) -> str:
    """sha256 of meta.json's content without its own checksum, independent of key order and spacing."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_meta(folder: Path, meta: dict[str, Any]) -> Path:
    """meta.json with its checksum (re)computed: for k3's own writers and for tests that edit a checkpoint
    on purpose."""
    meta = {**meta, "format": FORMAT}
    meta["meta_sha256"] = meta_checksum(meta)
    path = Path(folder) / "meta.json"
    path.write_text(json.dumps(meta, indent=1) + "\n")
    return path


def _step_folders(run_dir: Path) -> list[Path]:
    """Every step_XXXXXXXX folder, complete or not, oldest first."""
    return sorted(
        (p for p in Path(run_dir).glob("step_*") if p.is_dir() and STEP_NAME.fullmatch(p.name)), key=lambda p: p.name
    )


def step_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run (those with a meta.json), oldest first."""
    return [p for p in _step_folders(run_dir) if (p / "meta.json").exists()]


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
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [index_to_name[i] for i in g["params"]]}
        for g in sd["param_groups"]
    ]
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
    names = {id(p): n for n, p in model.named_parameters()}
    model_tensors = {k: v.detach().contiguous().cpu().clone() for k, v in model.state_dict().items()}
    opt_tensors, opt_meta = _optimizer_tensors(optimizer, names)
    return write_checkpoint(run_dir, step, model_tensors, opt_tensors, opt_meta, config, state, extra, keep_last)


def write_checkpoint(
    run_dir: str | Path,
    step: int,
    model_tensors: dict[str, torch.Tensor],
    opt_tensors: dict[str, torch.Tensor],
    opt_meta: dict[str, Any],
    config: K3Config,
    state: dict[str, Any],
    extra: dict[str, torch.Tensor] | None = None,
    keep_last: int = 3,
) -> Path:
    """save_checkpoint from tensors already gathered: the model's state_dict, the optimiser state keyed
    "<parameter name>::<key>" and its groups (k3.train.resharding builds them from several ranks)."""
    check_tokenizer_path(state.get("tokenizer"), run_dir)
    run_dir = Path(run_dir)
    final = run_dir / f"step_{step:08d}"
    tmp = run_dir / f".step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
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
    write_meta(tmp, meta)
    for f in (*FILES, "meta.json"):
        fsync_path(tmp / f)
    if final.exists():  # re-saving the same step: replace it
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_path(run_dir)
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

    def load_model(self, model: torch.nn.Module, others_experts: bool = False) -> None:
        """Load the weights strictly: a key the model cannot place, or one it lacks, is an error.
        others_experts: the model holds some of the routed experts (expert parallelism); the checkpoint's
        other experts are not loaded (every other key still must fit)."""
        tensors = self.tensors("model.safetensors")
        names = self._released_names(list(tensors), "model.safetensors")
        tensors = {names[k]: v for k, v in tensors.items()}
        own = model.state_dict()
        if others_experts:
            tensors = {k: v for k, v in tensors.items() if k in own or not ROUTED_EXPERT.fullmatch(k)}
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

    def load_optimizer(
        self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, others_experts: bool = False, place=None
    ) -> None:
        """The optimiser state, by parameter name. others_experts: as in load_model (the state of experts the
        model does not hold is skipped); place(param, tensor): the part of a saved tensor this process keeps
        (k3.train.resharding.local_part for sharded parameters)."""
        params = dict(model.named_parameters())
        names = {id(p): n for n, p in params.items()}
        flat = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        index = {n: i for i, n in enumerate(flat)}
        saved = self.meta["optimizer"]
        new = self._released_names([n for g in saved["groups"] for n in g["params"]], "the optimiser's groups")
        groups_names = [[new[n] for n in g["params"]] for g in saved["groups"]]
        if others_experts:
            groups_names = [[n for n in g if n in index or not ROUTED_EXPERT.fullmatch(n)] for g in groups_names]
        if [n for g in groups_names for n in g] != flat:
            raise CheckpointError(f"{self.path}: the optimiser's parameter groups differ from the checkpoint's")
        state: dict[int, dict[str, Any]] = {}
        for key, value in [*self.tensors("optimizer.safetensors").items(), *saved["scalars"].items()]:
            name, leaf = key.split("::")
            name = legacy_key(name)
            if name not in index:
                if others_experts and ROUTED_EXPERT.fullmatch(name):
                    continue
                raise CheckpointError(f"{self.path}: optimiser state for {name}, which the model does not have")
            if place is not None and isinstance(value, torch.Tensor):
                value = place(params[name], value)
            state.setdefault(index[name], {})[leaf] = value
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in names]}
            for g, names in zip(saved["groups"], groups_names, strict=True)
        ]
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def check_tokenizer_path(name: Any, run_dir: Path) -> None:
    """The training state names its tokenizer relative to the run folder; a path that leads out of it
    (absolute, or through '..') would load a file the run does not own."""
    if name is None:
        return
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{run_dir}: the training state's tokenizer must be a file name, got {name!r}")
    if Path(name).is_absolute() or ".." in Path(name).parts or "\\" in name:
        raise CheckpointError(
            f"{run_dir}: the training state's tokenizer {name!r} points outside the run folder; "
            f"it must be a path inside it, such as 'tokenizer.json'"
        )


def _check_shape(path: Path, meta: Any) -> None:
    """meta.json parsed as JSON but shaped otherwise than k3 writes it: name the first wrong field."""
    where = path / "meta.json"
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: a JSON {type(meta).__name__}, not the object k3 writes")
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"{path}: not a k3 checkpoint (format = {meta.get('format')!r}; k3 reads {', '.join(READABLE_FORMATS)})"
        )
    if meta["format"] == FORMAT:
        if "meta_sha256" not in meta:
            raise CheckpointError(f"{where} has no meta_sha256: it was edited or damaged")
        if meta["meta_sha256"] != meta_checksum(meta):
            raise CheckpointError(
                f"{where} does not match its own checksum (meta_sha256): it was edited or "
                f"damaged after it was written; k3 does not load a changed checkpoint"
            )
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{where}: step must be a non-negative integer, got {step!r}")
    for key, kind in (("config", dict), ("state", dict), ("optimizer", dict), ("sha256", dict)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{where}: {key} must be a JSON object, got {meta.get(key)!r:.60}")
    checksums = meta["sha256"]
    bad = [f for f in FILES if not isinstance(checksums.get(f), str)]
    if bad:
        raise CheckpointError(f"{where}: sha256 lacks a checksum for {', '.join(bad)}")
    position = meta["state"].get("position")
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise CheckpointError(f"{where}: state.position must be a non-negative integer, got {position!r}")
    opt = meta["optimizer"]
    if not isinstance(opt.get("groups"), list) or not isinstance(opt.get("scalars"), dict):
        raise CheckpointError(f"{where}: optimizer must hold a list of groups and an object of scalars")
    check_tokenizer_path(meta["state"].get("tokenizer"), path.parent)


def _load_one(path: Path, check_digests: bool) -> "Checkpoint":
    if not (path / "meta.json").exists():
        raise CheckpointError(f"{path} has no meta.json: the checkpoint is incomplete or damaged")
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'meta.json'} is not valid JSON (truncated or corrupted): {e}") from e
    _check_shape(path, meta)
    if check_digests:
        for f in FILES:
            if not (path / f).exists():
                raise CheckpointError(f"{path / f} is missing: the checkpoint is incomplete")
            if _sha256(path / f) != meta["sha256"][f]:
                raise CheckpointError(f"{path / f} does not match the checksum in meta.json: truncated or modified")
    return Checkpoint(path, meta)


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def load_checkpoint(
    path: str | Path, check_digests: bool = True, log: Callable[[str], None] | None = None
) -> Checkpoint:
    """A checkpoint folder, or a run folder (its newest usable checkpoint). Checks meta.json's shape and
    checksum and, with check_digests, every file's sha256 against it. In a run folder an unusable newest
    checkpoint is skipped for the next older one, with a message through `log` (default: a
    CheckpointWarning) naming the step used and why; if none is usable, the newest one's error is raised."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: a file, not a checkpoint or run directory")
    if (path / "meta.json").exists() or STEP_NAME.fullmatch(path.name):
        return _load_one(path, check_digests)
    found = _step_folders(path)
    if not found:
        raise CheckpointError(f"{path}: no checkpoint here (no step_*/meta.json)")
    errors = []
    for candidate in reversed(found):
        try:
            ckpt = _load_one(candidate, check_digests)
        except CheckpointError as e:
            errors.append(e)
            continue
        if errors:
            (log or _warn)(
                f"{path}: loading the older {ckpt.path.name} (step {ckpt.step}) because "
                + "; ".join(str(e) for e in errors)
            )
        return ckpt
    raise errors[0]


def config_diff(a: K3Config, b: K3Config) -> list[str]:
    """Fields where two configs differ, as 'name: a != b'."""
    da, db = a.to_dict(), b.to_dict()
    return [f"{k}: {da[k]!r} != {db[k]!r}" for k in da if k != "extra_hf" and da[k] != db[k]]
