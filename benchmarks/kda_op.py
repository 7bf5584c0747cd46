"""KDA op benchmark: k3's chunked and recurrent KDA next to flash-linear-attention's PyTorch references.

    python benchmarks/kda_op.py                 # B=1, H=4, K=V=128, T in 1024 4096 16384, fp32, 2 threads
    python benchmarks/kda_op.py --quick         # T=1024 only, fewer repeats
    python benchmarks/kda_op.py --markdown      # also print the table for docs/benchmarks.md

Peers, all in this run on the same inputs: fla 0.6.0's `naive_recurrent_kda` and `naive_chunk_kda`
(pure PyTorch, loaded from fla/ops/kda/naive.py so Triton is not needed), and autograd through k3's
per-timestep reference for the backward comparison. Install fla with
`pip install --no-deps flash-linear-attention==0.6.0 fla-core==0.6.0 einops`.

Achieved GFLOP/s comes from an explicit count of the matmuls the chunked forward executes
(`chunk_flops`), next to the fp32 matmul rate measured here (a 2048² matmul).
"""

import argparse
import datetime
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from k3.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate, naive_recurrent_kda
from k3.ops.kda.backend import fla_naive
from k3.ops.kda.chunk import chunk_kda_fwd
from k3.ops.kda.chunk_terms import SUB

SLOW_S = 2.0  # measurements slower than this per call get fewer repeats
MAX_AUTOGRAD_T = 4096  # autograd through the per-token loop keeps ~3 states per token: 13 GB at 16K


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
    sub = min(SUB, C)
    nb = C // sub
    per_chunk = (
        2 * (2 * nb * sub * sub * K)  # q·k and k·k inside each row block
        + 2 * sum(2 * sub * (i * sub) * K for i in range(1, nb))  # row blocks against earlier columns
        + C**3  # (I + βA)⁻¹ by triangular solve against the identity
        + 2 * C * C * (V + K)  # U = T·βv, W = T·βkΓ
        + 3 * 2 * C * K * V  # W·S, (qΓ)·S, (kΓ')ᵀ·u
        + 2 * C * C * V  # Aqk·u
    )
    return B * H * -(-T // C) * per_chunk


def make_inputs(T: int, H: int, K: int, V: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = kda_gate(torch.randn(1, T, H, K, generator=gen), torch.zeros(H), None, -5.0)
    beta = torch.rand(1, T, H, generator=gen).sigmoid()
    return q, k, v, g, beta


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def autograd_chunk(q, k, v, g, beta):
    """chunk_kda's forward with autograd recording every operation (no hand-written backward)."""
    o, S, _ = chunk_kda_fwd(q, k, v, g, beta, q.shape[-1] ** -0.5, None, 64)
    return o, S


def fwd_bwd(fn, inputs):
    leaves = [x.clone().requires_grad_() for x in inputs]

    def run():
        for x in leaves:
            x.grad = None
        o, _ = fn(*leaves)
        o.square().sum().backward()

    return run


def bench(T: int, H: int, K: int, V: int, repeats: int, fla) -> dict:
    inputs = make_inputs(T, H, K, V)
    row = {"T": T}
    with torch.no_grad():
        row["chunk"] = timed(lambda: chunk_kda(*inputs), repeats)
        row["recurrent"] = timed(lambda: fused_recurrent_kda(*inputs), repeats)
        if fla is not None:
            row["fla_recurrent"] = timed(lambda: fla.naive_recurrent_kda(*inputs), repeats)
            row["fla_chunk"] = timed(lambda: fla.naive_chunk_kda(*inputs), repeats)
            # The comparison is only meaningful if both compute the same thing.
            row["err_vs_fla"] = rel_err(chunk_kda(*inputs)[0], fla.naive_recurrent_kda(*inputs)[0])
    row["chunk_fwd_bwd"] = timed(fwd_bwd(chunk_kda, inputs), repeats)
    # the previous backward: autograd through the same chunked forward (k3's own baseline)
    row["chunk_autograd_fwd_bwd"] = timed(fwd_bwd(autograd_chunk, inputs), repeats)
    if T <= MAX_AUTOGRAD_T:
        row["recurrent_fwd_bwd"] = timed(fwd_bwd(naive_recurrent_kda, inputs), min(repeats, 3))
    row["gflops"] = chunk_flops(1, T, H, K, V) / row["chunk"] / 1e9
    return row


def fmt_ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:,.1f}"


def fmt_x(num: float | None, den: float | None) -> str:
    return "—" if num is None or den is None else f"{num / den:.1f}×"


def table(rows: list[dict], mm: float) -> list[str]:
    head = (
        "| T | k3 chunk fwd ms | GFLOP/s (% of matmul) | k3 chunk fwd+bwd ms (÷ fwd) "
        "| autograd through the chunk fwd+bwd ms | hand-written vs autograd | k3 recurrent ms "
        "| fla naive_recurrent ms | fla naive_chunk ms | recurrent autograd fwd+bwd ms "
        "| chunk vs fla recurrent | chunk vs fla chunk | fwd+bwd vs recurrent autograd |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        g = r.get
        lines.append(
            f"| {r['T']} | {fmt_ms(r['chunk'])} | {r['gflops']:.1f} ({100 * r['gflops'] / mm:.0f}%) "
            f"| {fmt_ms(r['chunk_fwd_bwd'])} ({r['chunk_fwd_bwd'] / r['chunk']:.1f}×) "
            f"| {fmt_ms(r['chunk_autograd_fwd_bwd'])} | {fmt_x(r['chunk_autograd_fwd_bwd'], r['chunk_fwd_bwd'])} "
            f"| {fmt_ms(r['recurrent'])} | {fmt_ms(g('fla_recurrent'))} "
            f"| {fmt_ms(g('fla_chunk'))} | {fmt_ms(g('recurrent_fwd_bwd'))} "
            f"| {fmt_x(g('fla_recurrent'), r['chunk'])} | {fmt_x(g('fla_chunk'), r['chunk'])} "
            f"| {fmt_x(g('recurrent_fwd_bwd'), r['chunk_fwd_bwd'])} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="T=1024 only, 3 repeats")
    p.add_argument("--markdown", action="store_true", help="print the markdown table for docs/benchmarks.md")
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
    cpu = platform.processor() or platform.machine()
    print(f"KDA op, B=1 H={H} K=V={D} fp32, {torch.get_num_threads()} threads, torch {torch.__version__}, {cpu}")
    print(f"fp32 matmul (2048²): {mm:.1f} GFLOP/s")
    rows = []
    for T in args.T:
        row = bench(T, H, D, D, args.repeats, fla)
        rows.append(row)
        err = f", chunk vs fla recurrent rel. error {row['err_vs_fla']:.1e}" if "err_vs_fla" in row else ""
        print(f"T={T}: chunk {fmt_ms(row['chunk'])} ms, {row['gflops']:.1f} GFLOP/s{err}", flush=True)
    print()
    print("\n".join(table(rows, mm)))
    if args.markdown:
        print(
            f"\n{datetime.date.today()}, {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
            f"fp32 matmul {mm:.1f} GFLOP/s; times are medians of {args.repeats} runs (2 for runs over {SLOW_S} s)"
        )


if __name__ == "__main__":
    main()
