"""What the experiment scripts share: flags, a resumable result store, tables, plots, and training runs.

Every script takes `--quick` (a reduced version for the slow test, minutes) and `--out DIR` (default
runs/evidence/<name>/, or runs/evidence-quick/<name>/ with --quick). Each unit of work (one rule, one
seed, one training run) stores its result in DIR/results.json as soon as it finishes; a rerun skips
what is stored, and training runs resume from their checkpoints, so an interrupted script continues.
The script ends by writing DIR/table.md and DIR/<name>.png, and DIR/evidence.json: the claim, the verdict
the script computes from its results by the rule it states, the seeds, steps, wall seconds, the machine's
load average around each unit, and the rows behind the table. A full run (no --quick, default --out) also
copies it to docs/evidence/<name>.json, which docs/evidence.md quotes.
"""

import argparse
import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from k3.formats.files import atomic_write


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"experiments/{name}.py", description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the reduced version (a few minutes)")
    p.add_argument("--out", default=None, help=f"results folder (default runs/evidence/{name}/)")
    return p


def out_dir(name: str, args) -> Path:
    out = Path(args.out or f"runs/evidence{'-quick' if args.quick else ''}/{name}")
    out.mkdir(parents=True, exist_ok=True)
    return out


class Store:
    """results.json: one entry per finished unit of work, written atomically after each."""

    def __init__(self, out: Path):
        self.path = out / "results.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, key: str):
        return self.data.get(key)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        atomic_write(self.path, json.dumps(self.data, indent=1))

    def run(self, key: str, fn):
        """fn()'s result under `key`, computed once, with its wall time in seconds under 'seconds' and the
        1-minute load average before and after under 'load' (a number near the core count or above means
        something else ran beside it, and its timings are not to be trusted)."""
        if key not in self.data:
            load_before = os.getloadavg()[0]
            t0 = time.perf_counter()
            value = fn()
            if isinstance(value, dict):
                value.setdefault("seconds", time.perf_counter() - t0)
                value.setdefault("load", [round(load_before, 2), round(os.getloadavg()[0], 2)])
            self.put(key, value)
        return self.data[key]

    def totals(self) -> dict:
        """wall_s (the units' seconds summed) and load_avg (min and max of the load averages recorded)."""
        units = [v for v in self.data.values() if isinstance(v, dict)]
        loads = [x for v in units for x in v.get("load", [])]
        return {
            "wall_s": round(sum(v.get("seconds", 0.0) for v in units), 1),
            "load_avg": [min(loads), max(loads)] if loads else None,
        }


VERDICTS = ("reproduced", "not reproduced", "mixed")


def per_seed_verdict(shown: list[bool]) -> str:
    """The verdict of a claim checked seed by seed: reproduced if every seed shows it, not reproduced if none
    does, mixed if the seeds disagree."""
    return "reproduced" if all(shown) else "not reproduced" if not any(shown) else "mixed"


def write_evidence(name: str, out: Path, args, store: Store, **fields) -> dict:
    """out/evidence.json (and docs/evidence/<name>.json for a full run into the default folder): `fields`
    must hold claim, verdict (one of VERDICTS), rule (how the verdict follows from the rows), seeds, steps
    and rows; wall_s and load_avg come from the store, the CPU and torch version from this process."""
    import platform

    import torch

    missing = {"claim", "verdict", "rule", "seeds", "steps", "rows"} - set(fields)
    if missing or fields["verdict"] not in VERDICTS:
        raise ValueError(f"evidence for {name}: missing {sorted(missing)} or verdict not in {VERDICTS}")
    record = {"name": name, **fields, **store.totals(), "quick": bool(args.quick)}
    record["machine"] = {
        "cpu": _cpu_model() or platform.processor(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    text = json.dumps(record, indent=1) + "\n"
    atomic_write(out / "evidence.json", text)
    if not args.quick and args.out is None:
        docs = Path(__file__).resolve().parent.parent / "docs" / "evidence"
        docs.mkdir(parents=True, exist_ok=True)
        atomic_write(docs / f"{name}.json", text)
        print(f"wrote {docs / f'{name}.json'}")
    print(f"verdict: {record['verdict']} ({record['rule']})")
    return record


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_tables(out: Path, sections: list[tuple[str, list[str], list[list]]], notes: str = "") -> str:
    """Markdown tables (title, header, rows) in out/table.md, printed too."""
    text = "\n\n".join(f"#### {title}\n\n{markdown_table(header, rows)}" for title, header, rows in sections)
    text += ("\n\n" + notes if notes else "") + "\n"
    atomic_write(out / "table.md", text)
    print(text)
    return text


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def base_run(quick: bool) -> Path:
    """A run folder whose tokenizer and packed stdlib tokens the experiments' training runs reuse (learning
    the BPE and packing the standard library takes minutes): $K3_EVIDENCE_BASE, runs/quickstart, or one
    made here by a one-step `k3 train`."""
    from k3.cli import main

    for candidate in (os.environ.get("K3_EVIDENCE_BASE"), "runs/quickstart"):
        if candidate and (Path(candidate) / "train_tokens.npy").exists():
            return Path(candidate)
    base = Path("runs/evidence-base")
    if not (base / "train_tokens.npy").exists():
        main(["train", "--steps", "1", "--out", str(base), "--no-progress", "--override"])
    return base


def same_data(base: Path) -> list[str]:
    """The flags that make a run read base's data with base's tokenizer (otherwise it would learn and pack
    its own): its --data, --vocab-size and --val-fraction as base's run.json recorded them."""
    record = json.loads((base / "run.json").read_text())
    flags = ["--vocab-size", str(record["flags"]["vocab_size"]), "--val-fraction", str(record["flags"]["val_fraction"])]
    if record["data"]["path"] is not None:
        flags += ["--data", record["data"]["path"]]
    return flags


def vocab_size(base: Path) -> int:
    from k3.formats.tokenizer import K3Tokenizer

    return K3Tokenizer.load(base / "tokenizer.json").vocab_size


def init_checkpoint(out: Path, config, base: Path, seed: int = 0) -> Path:
    """A step-0 checkpoint of a K3Model(config) seeded with `seed`, with base's tokenizer beside it: what
    `k3 train --init-from` starts a model variant from (the presets have no flag for K3Config's switches)."""
    import torch

    from k3.formats.checkpoint import save_checkpoint, step_dirs
    from k3.model import K3Model
    from k3.train.optim import build_optimizer

    if not step_dirs(out):
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(base / "tokenizer.json", out / "tokenizer.json")
        torch.manual_seed(seed)
        model = K3Model(config)
        state = {"position": 0, "tokenizer": "tokenizer.json", "init": {"seed": seed}}
        save_checkpoint(out, 0, model, build_optimizer(model, lr=1e-3, weight_decay=0.0), config, state)
    return out


def train(out: Path, flags: list[str], base: Path, init: Path | None = None) -> list[dict]:
    """`k3 train --out out *flags` on base's tokenizer and tokens (from the weights of `init` when given),
    resumed if it was interrupted; returns its metrics.jsonl records (a finished run trains nothing again)."""
    from k3.formats.checkpoint import step_dirs

    if not (out / "tokenizer.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        for name in ("run.json", "tokenizer.json"):
            shutil.copyfile(base / name, out / name)
        if init is not None:  # recorded as the run's source up front: --override would otherwise repack the data
            record = json.loads((out / "run.json").read_text())
            record["flags"]["init_from"] = str(init.resolve())
            atomic_write(out / "run.json", json.dumps(record, indent=1))
        for name in ("train_tokens.npy", "val_tokens.npy"):  # read only, never rewritten: shared
            (out / name).symlink_to((base / name).resolve())
    resume = ["--resume"] if step_dirs(out) else []
    source = ["--init-from", str(init)] if init is not None else []
    source += same_data(base)
    if "--ckpt-every" not in flags:  # an interrupted experiment resumes from at most 10 steps back
        source += ["--ckpt-every", "10"]
    return run_k3(out, ["train", *flags, *source, "--out", str(out), "--override", "--no-progress", *resume])


def run_k3(out: Path, argv: list[str], log_name: str = "train.log") -> list[dict]:
    """`k3 *argv` in this process, its output appended to out/log_name; the metrics.jsonl records of the run
    folder `out` it wrote. A failure stops the experiment with the command and where its log is."""
    from k3.cli import main
    from k3.formats.files import latest_timeline, read_jsonl

    print(f"k3 {' '.join(argv)}  (log: {out / log_name})", flush=True)
    with open(out / log_name, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"k3 {' '.join(argv)} failed with status {code}; see {out / log_name}")
    return latest_timeline(read_jsonl(out / "metrics.jsonl"))
