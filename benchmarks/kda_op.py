"""KDA op benchmark on gates that decay as trained models' do: k3's chunked KDA (its C++ CPU kernel and its PyTorch
reference) and recurrent KDA next to flash-linear-attention's PyTorch references, one row per gate regime.

    python benchmarks/kda_op.py                 # B=1, H=4, K=V=128, T=4096, fp32, 2 threads, four gate regimes
    python benchmarks/kda_op.py --T 1024 16384  # other lengths
    python benchmarks/kda_op.py --quick         # T=1024, 3 repeats
    python benchmarks/kda_op.py --markdown      # also print the tables for docs/benchmarks.md

Gate regimes (g: the log-decay per token and key channel):
  weak       −0.1·sigmoid(N(0,1)), mean −0.05: what random initialisation gives (the old benchmark's inputs)
  trained    −5·sigmoid(N(0,1)), spread across K3's bound (g ≥ −5) as a trained model's
  saturated  −5 everywhere: the bound itself
  unbounded  Kimi Linear's −exp(A)·softplus(x) with A ~ N(1, 1) per channel, clipped at −20

Peers, all in this run on the same inputs: fla 0.6.0's `naive_recurrent_kda` and `naive_chunk_kda` (pure PyTorch,
loaded from fla/ops/kda/naive.py so Triton is not needed); install fla with
`pip install --no-deps flash-linear-attention==0.6.0 fla-core==0.6.0 einops`. The decode step is one token of
`fused_recurrent_kda` updating a (H, K, V) state in place, the state first prefilled with the regime's gate.

"k3 chunk" is what chunk_kda runs by default on the CPU, the C++ kernel (k3.ops.kda.cpu_kernel); "reference" is
the same op with K3_KDA_CPU_KERNEL=off, the PyTorch code the kernel is tested against. GFLOP/s comes from an
explicit count of the matmuls the reference's chunked forward executes (`chunk_flops`; the kernel's own count,
with its 16-token row blocks and exact pairs, is within 1% of it), beside the fp32 matmul rate measured in the same
run (a 2048² matmul). Flatness: the slowest regime over the fastest.
"""

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from k3.ops.kda import chunk_kda, cpu_kernel, fused_recurrent_kda
from k3.ops.kda.backend import fla_naive
from machine import cpu

SLOW_S = 2.0  # measurements slower than this per call get fewer repeats
REGIMES = ("weak", "trained", "saturated", "unbounded")


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats runs after one warm-up (fewer when a run is slow)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    runs = [first] if first > SLOW_S * 5 else []
    n = repeats if first < SLOW_S else min(repeats, 2)
    while len(runs) < n:
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def matmul_gflops(repeats: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / timed(lambda: a @ b, repeats) / 1e9


def chunk_flops(B: int, T: int, H: int, K: int, V: int, C: int = 64) -> int:
    """Multiply-add FLOPs (2 per MAC) of the matmuls chunk_kda's forward executes, dense as executed."""
    levels = [C >> i for i in range(C.bit_length() - 1)]  # the halving's block sizes C, C/2, ..., 2
    per_chunk = (
        sum(2 * 2 * (C // b) * (b // 2) ** 2 * K for b in levels)  # q·k and k·k, one quadrant per block and level
        + sum(2 * 2 * (C // b) * (b // 2) ** 3 for b in levels)  # (I + βA)⁻¹ by halving: two matmuls per quadrant
        + 2 * C * C * (V + K)  # U = T·βv, W = T·βkΓ
        + 3 * 2 * C * K * V  # W·S, (qΓ)·S, (kΓ')ᵀ·u
        + 2 * C * C * V  # Aqk·u
    )
    return B * H * -(-T // C) * per_chunk


def gate(regime: str, T: int, H: int, K: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(1, T, H, K, generator=gen)
    if regime == "weak":
        return -0.1 * x.sigmoid()
    if regime == "trained":
        return -5 * x.sigmoid()
    if regime == "saturated":
        return torch.full_like(x, -5.0)
    A = torch.randn(H, K, generator=gen) + 1
    return (-A.exp() * F.softplus(x)).clamp(min=-20)


def make_inputs(regime: str, T: int, H: int, K: int, V: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    beta = torch.rand(1, T, H, generator=gen).sigmoid()
    return q, k, v, gate(regime, T, H, K, gen), beta


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def fwd_bwd(fn, inputs):
    leaves = [x.clone().requires_grad_() for x in inputs]

    def run():
        for x in leaves:
            x.grad = None
        o, _ = fn(*leaves)
        o.square().sum().backward()

    return run


def decode_step(inputs, repeats: int) -> float:
    """Seconds per decode step: one token through fused_recurrent_kda, the prefilled state updated in place."""
    with torch.inference_mode():
        _, state = chunk_kda(*inputs, output_final_state=True)
        step = [x[:, -1:].clone() for x in inputs]
        n = 50
        return (
            timed(
                lambda: [fused_recurrent_kda(*step, initial_state=state, inplace_final_state=True) for _ in range(n)],
                repeats,
            )
            / n
        )


@contextlib.contextmanager
def reference():
    """chunk_kda on its PyTorch reference instead of the C++ kernel."""
    previous = os.environ.get(cpu_kernel.ENV_VAR)
    os.environ[cpu_kernel.ENV_VAR] = "off"
    try:
        yield
    finally:
        os.environ.pop(cpu_kernel.ENV_VAR) if previous is None else os.environ.update({cpu_kernel.ENV_VAR: previous})


def bench(regime: str, T: int, H: int, K: int, V: int, repeats: int, fla) -> dict:
    inputs = make_inputs(regime, T, H, K, V)
    row = {"regime": regime, "T": T, "g_mean": inputs[3].mean().item(), "g_min": inputs[3].min().item()}
    with reference():
        with torch.no_grad():
            row["ref"] = timed(lambda: chunk_kda(*inputs), repeats)
        row["ref_fwd_bwd"] = timed(fwd_bwd(chunk_kda, inputs), repeats)
    with torch.no_grad():
        row["chunk"] = timed(lambda: chunk_kda(*inputs), repeats)
        row["recurrent"] = timed(lambda: fused_recurrent_kda(*inputs), repeats)
        if fla is not None:
            row["fla_recurrent"] = timed(lambda: fla.naive_recurrent_kda(*inputs), repeats)
            row["fla_chunk"] = timed(lambda: fla.naive_chunk_kda(*inputs), repeats)
            # The comparison is only meaningful if both compute the same thing.
            row["err_vs_fla"] = rel_err(chunk_kda(*inputs)[0], fla.naive_recurrent_kda(*inputs)[0])
    row["chunk_fwd_bwd"] = timed(fwd_bwd(chunk_kda, inputs), repeats)
    row["decode"] = decode_step(inputs, repeats)
    row["gflops"] = chunk_flops(1, T, H, K, V) / row["chunk"] / 1e9
    return row


def fmt_ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:,.1f}"


def fmt_x(num: float | None, den: float | None) -> str:
    return "—" if num is None or den is None else f"{num / den:.1f}×"


def table(rows: list[dict], mm: float) -> list[str]:
    head = (
        "| T | gate (mean, min) | k3 chunk fwd ms | GFLOP/s (% of matmul) | k3 chunk fwd+bwd ms (÷ fwd) "
        "| reference fwd ms | reference fwd+bwd ms | kernel vs reference fwd, fwd+bwd "
        "| decode step µs | k3 recurrent ms | fla naive_recurrent ms | fla naive_chunk ms "
        "| chunk vs fla recurrent | chunk vs fla chunk |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        g = r.get
        lines.append(
            f"| {r['T']} | {r['regime']} ({r['g_mean']:.2f}, {r['g_min']:.1f}) | {fmt_ms(r['chunk'])} "
            f"| {r['gflops']:.1f} ({100 * r['gflops'] / mm:.0f}%) "
            f"| {fmt_ms(r['chunk_fwd_bwd'])} ({r['chunk_fwd_bwd'] / r['chunk']:.2f}×) "
            f"| {fmt_ms(r['ref'])} | {fmt_ms(r['ref_fwd_bwd'])} "
            f"| {fmt_x(r['ref'], r['chunk'])}, {fmt_x(r['ref_fwd_bwd'], r['chunk_fwd_bwd'])} "
            f"| {r['decode'] * 1e6:,.0f} "
            f"| {fmt_ms(r['recurrent'])} | {fmt_ms(g('fla_recurrent'))} | {fmt_ms(g('fla_chunk'))} "
            f"| {fmt_x(g('fla_recurrent'), r['chunk'])} | {fmt_x(g('fla_chunk'), r['chunk'])} |"
        )
    return lines


def flatness(rows: list[dict]) -> list[str]:
    """Per T: the slowest regime over the fastest, for the forward, forward+backward and decode step."""
    lines = [
        "| T | fwd slowest ÷ fastest | fwd+bwd slowest ÷ fastest | decode slowest ÷ fastest |",
        "|---|---|---|---|",
    ]
    for T in sorted({r["T"] for r in rows}):
        cells = []
        for key in ("chunk", "chunk_fwd_bwd", "decode"):
            vals = {r["regime"]: r[key] for r in rows if r["T"] == T}
            hi, lo = max(vals, key=vals.get), min(vals, key=vals.get)
            cells.append(f"{vals[hi] / vals[lo]:.2f} ({hi} ÷ {lo})")
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096])
    p.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="T=1024 only, 3 repeats")
    p.add_argument("--markdown", action="store_true", help="print the markdown tables for docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.quick:
        args.T, args.repeats = [1024], 3
    torch.set_num_threads(args.threads)
    fla = fla_naive()
    if fla is None:
        print(
            "fla not installed: its columns stay empty (pip install --no-deps flash-linear-attention==0.6.0 "
            "fla-core==0.6.0 einops)",
            file=sys.stderr,
        )

    H, D = args.heads, args.head_dim
    mm = matmul_gflops(args.repeats)
    print(f"KDA op, B=1 H={H} K=V={D} fp32, {torch.get_num_threads()} threads, torch {torch.__version__}, {cpu()}")
    print(f"chunked op on the CPU: {cpu_kernel.describe()}")
    print(f"fp32 matmul (2048²): {mm:.1f} GFLOP/s")
    rows = []
    for T in args.T:
        for regime in args.regimes:
            row = bench(regime, T, H, D, D, args.repeats, fla)
            rows.append(row)
            err = f", vs fla recurrent rel. error {row['err_vs_fla']:.1e}" if "err_vs_fla" in row else ""
            print(
                f"T={T} {regime}: chunk {fmt_ms(row['chunk'])} ms, fwd+bwd {fmt_ms(row['chunk_fwd_bwd'])} ms, "
                f"decode {row['decode'] * 1e6:.0f} µs{err}",
                flush=True,
            )
    print()
    print("\n".join(table(rows, mm)))
    print()
    print("\n".join(flatness(rows)))
    if args.markdown:
        print(
            f"\n{datetime.date.today()}, {cpu()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
            f"fp32 matmul {mm:.1f} GFLOP/s; times are medians of {args.repeats} runs (2 for runs over {SLOW_S} s)"
        )


if __name__ == "__main__":
    main()
