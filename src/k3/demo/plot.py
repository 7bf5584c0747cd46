"""`k3 plot routing`: the routing demo's comparison as one static PNG, for the docs and the README.

Top row: tokens per expert in the batch after one bias update, for each rule, with the target q dashed.
Bottom: MaxVio over the batches for every rule. The numbers are `route_batches`', as on the page.
"""

from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from k3.demo.routing import RoutingParams, RoutingResult, route_batches
from k3.formats.files import atomic_write

RULES_SHOWN = [  # (rule, cutoff, label); the fixed step keeps SPEC §2.6's u = 1e-3
    ("topk", "kplus1", "plain top-k"),
    ("fixed", "kplus1", "fixed step, u = 1e-3"),
    ("quantile", "kplus1", "Quantile Balancing, (k+1)-th cutoff"),
    ("quantile", "exact", "Quantile Balancing, exact cutoff"),
]
COLORS = ["#7a7f88", "#3f7cc4", "#d2643a", "#2e9b63"]


def routing_results(base: RoutingParams) -> list[tuple[str, RoutingResult]]:
    """(label, result) for each rule of RULES_SHOWN, all on the same batches of scores as `base`."""
    return [(label, route_batches(replace(base, rule=rule, cutoff=cutoff))) for rule, cutoff, label in RULES_SHOWN]


def plot_routing(out: str | Path, base: RoutingParams | None = None) -> Path:
    """Write the comparison to `out` (PNG). `base` sets tokens, experts, k, skew, seed and the batches shown
    (default: the page's figure, 20 batches); its rule is ignored. Returns the path."""
    base = base or RoutingParams(batches=20)
    if base.batches < 2:
        raise ValueError(f"batches = {base.batches}: the figure shows the batch after one update, so at least 2")
    results = routing_results(base)
    q = base.target_load
    fig = plt.figure(figsize=(11, 6.5))
    grid = fig.add_gridspec(2, len(results), height_ratios=[1.1, 1])
    top = max(max(r.batches[1].loads) for _, r in results) * 1.1
    for i, ((label, result), color) in enumerate(zip(results, COLORS, strict=True)):
        ax = fig.add_subplot(grid[0, i])
        loads = result.batches[1].loads
        ax.bar(range(base.experts), loads, color=color, width=0.8)
        ax.axhline(q, color="black", ls="--", lw=1.2)
        ax.set_ylim(0, top)
        ax.set_title(f"{label}\nbatch 2: MaxVio {result.batches[1].maxvio:.2f}", fontsize=9)
        ax.set_xlabel("expert", fontsize=8)
        if i == 0:
            ax.set_ylabel("tokens")
            ax.annotate(f"q = {q:g}", (0, q), xytext=(0, 3), textcoords="offset points", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax = fig.add_subplot(grid[1, :])
    for (label, result), color in zip(results, COLORS, strict=True):
        ax.plot(
            range(1, base.batches + 1), [b.maxvio for b in result.batches], "o-", ms=3, lw=1.3, color=color, label=label
        )
    ax.set(xlabel="batch (the bias is set from each batch for the next)", ylabel="MaxVio = (max − mean) / mean")
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(
        f"Routing {base.tokens} tokens to {base.experts} experts, top-{base.k}, skew {base.skew:g}, "
        f"seed {base.seed}: k3's router and balancers",
        fontsize=11,
    )
    fig.tight_layout()
    out = Path(out)
    atomic_write(out, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return out
