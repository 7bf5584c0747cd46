"""`k3 plot RUN_DIR`: the loss curves and per-layer MaxVio of a run, as PNG files beside its log."""

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from k3.formats.files import atomic_write, latest_timeline, read_jsonl


def read_metrics(run: Path, log: Callable[[str], None] | None = None) -> list[dict]:
    """metrics.jsonl as the run went: a resumed run's lines replace those the interrupted run logged after
    its checkpoint, and a torn last line (a kill mid-append) is dropped and reported through `log`."""
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics log (is {run} a k3 training run?)")
    return latest_timeline(read_jsonl(path, log=log))


def _save(fig, path: Path) -> Path:
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
    return path


def plot_run(run: str | Path, log: Callable[[str], None] | None = None) -> list[Path]:
    """Writes loss.png (train and validation loss) and, when logged, maxvio.png. Returns the paths."""
    run = Path(run)
    records = read_metrics(run, log)
    if not records:
        raise ValueError(f"{run}/metrics.jsonl is empty")
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1, label="train")
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=f"{run.name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, run / "loss.png"))

    with_vio = [r for r in records if r.get("maxvio")]
    if with_vio:
        fig, ax = plt.subplots(figsize=(7, 4))
        for layer in range(len(with_vio[0]["maxvio"])):
            ax.plot(
                [r["step"] for r in with_vio],
                [r["maxvio"][layer] for r in with_vio],
                lw=1,
                label=f"MoE layer {layer + 1}",
            )
        ax.set(xlabel="step", ylabel="MaxVio = (max load − mean) / mean", title=f"{run.name}: expert load balance")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        written.append(_save(fig, run / "maxvio.png"))
    return written
