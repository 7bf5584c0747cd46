"""Bounded decay and SiTU numerics (SPEC §2.1, §2.4): what the bounds keep finite, and what happens without them.

(a) KDA at T = 65,536 tokens in fp32 with every log-decay g equal to a constant, at the bound (−5), inside
it (−1) and past it (−8, −20: what an unbounded gate can produce). For each: the in-chunk decayed
products e^{G_t − G_s} computed as dense matmuls the textbook way (one split e^{G_t}·e^{−G_s} per 64-token
chunk) and k3's way (pivots at every level of halving the chunk, every factor ≤ 1: `DecayLevels`): the fraction
of the products the attention uses that came out inf/NaN; then k3's `chunk_kda` against the float64 per-token
recurrence: finite, relative RMS error, time.
The same with a gate from the unbounded Kimi Linear form (g = −exp(A_log)·softplus(f + dt_bias)) and
from K3's bounded form (g = −5·sigmoid(exp(A_log)·(f + dt_bias))) on the same f.

(b) SiTU-GLU vs SwiGLU on extreme inputs: max |output| for g = u = ±x, x up to 3e38 (fp32) and up to
3e38 in bf16; and for Gaussian inputs of growing scale, the share of outputs beyond FP8 E4M3's largest
value (448), which is what the routed experts' MXFP8 activations must hold.

    python experiments/bounded_numerics.py            # T = 65,536
    python experiments/bounded_numerics.py --quick    # T = 8,192
"""

import sys
import time

import torch
import torch.nn.functional as F
from common import Store, out_dir, parser, save_figure, write_tables

from k3.model.situ import situ
from k3.ops.kda import chunk_kda, kda_gate, l2norm, naive_recurrent_kda
from k3.ops.kda.decay import LOG2E, DecayLevels

NAME = "bounded_numerics"
DECAYS = (-1.0, -5.0, -8.0, -20.0)
H, K, V, C = 1, 16, 16, 64
FP8_MAX = 448.0


def inputs(T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(1, T, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen)
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen))
    f = torch.randn(1, T, H, K, generator=gen) * 3.0
    return q, k, v, beta, f


def nonfinite_share(q, k, g) -> dict:
    """The share of used in-chunk products (s ≤ t) that are not finite, over the first 16 chunks, for the
    textbook split and for k3's pivoted split."""
    n = 16
    qc, kc, gc = (x[0, : n * C, 0].view(1, n, C, K) for x in (q, k, g))
    G = gc.cumsum(2)
    textbook = (qc * G.exp()) @ (kc * (-G).exp()).transpose(-1, -2)  # (1, n, C, C)
    used = torch.ones(C, C, dtype=torch.bool).tril()
    pivoted = DecayLevels(G * LOG2E).products([qc], kc)[0]  # the levels take G in bits
    pivoted.diagonal(dim1=-2, dim2=-1).copy_((qc * kc).sum(-1))
    return {
        "textbook": (~torch.isfinite(textbook[..., used])).double().mean().item(),
        "pivoted": (~torch.isfinite(pivoted[..., used])).double().mean().item(),
    }


def kda_case(T: int, g: torch.Tensor, q, k, v, beta) -> dict:
    t0 = time.perf_counter()
    o, S = chunk_kda(q, k, v, g, beta, output_final_state=True)
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        ref_o, _ = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)))
    finite = bool(torch.isfinite(o).all() and torch.isfinite(S).all())
    err = ((o.double() - ref_o).square().mean().sqrt() / ref_o.square().mean().sqrt()).item() if finite else None
    return {
        "finite": finite,
        "rel_rms": err,
        "chunk_seconds": seconds,
        "g_min": g.min().item(),
        **nonfinite_share(q, k, g),
    }


def situ_case() -> dict:
    xs = [1.0, 10.0, 100.0, 1e4, 1e8, 1e30, 3e38]
    out = {"x": xs}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        for sign in (1, -1):
            x = torch.tensor([sign * v for v in xs], dtype=dtype)
            out[f"situ_{name}_{sign}"] = situ(x, x).abs().float().tolist()
            out[f"swiglu_{name}_{sign}"] = (F.silu(x) * x).abs().float().tolist()
    gen = torch.Generator().manual_seed(0)
    scales = [1, 10, 30, 100, 300, 1000]
    out["scales"] = scales
    g, u = torch.randn(2, 1_000_000, generator=gen)
    out["situ_over_fp8"] = [(situ(s * g, s * u).abs() > FP8_MAX).double().mean().item() for s in scales]
    out["swiglu_over_fp8"] = [((F.silu(s * g) * s * u).abs() > FP8_MAX).double().mean().item() for s in scales]
    out["situ_max"] = [situ(s * g, s * u).abs().max().item() for s in scales]
    out["swiglu_max"] = [(F.silu(s * g) * s * u).abs().max().item() for s in scales]
    return out


def main() -> None:
    args = parser(NAME, __doc__).parse_args()
    out = out_dir(NAME, args)
    store = Store(out)
    T = 8192 if args.quick else 65536
    q, k, v, beta, f = inputs(T)
    for decay in DECAYS:
        store.run(f"kda/{T}/const{decay}", lambda d=decay: kda_case(T, torch.full((1, T, H, K), d), q, k, v, beta))
    A_log, dt_bias = torch.zeros(H), torch.zeros(H * K)
    gates = {
        "kimi-linear": kda_gate(f, A_log, dt_bias, lower_bound=None),
        "k3-bounded": kda_gate(f, A_log, dt_bias, lower_bound=-5.0),
    }
    for name, g in gates.items():
        store.run(f"kda/{T}/{name}", lambda g=g: kda_case(T, g, q, k, v, beta))
    store.run("situ", situ_case)
    report(out, store, T)


def report(out, store, T: int) -> None:
    import matplotlib.pyplot as plt

    labels = [f"g = {d:g} everywhere" for d in DECAYS] + ["Kimi Linear gate, f ~ N(0, 3²)", "K3 bounded gate, same f"]
    keys = [f"const{d}" for d in DECAYS] + ["kimi-linear", "k3-bounded"]
    rows = []
    for label, key in zip(labels, keys, strict=True):
        r = store.get(f"kda/{T}/{key}")
        rows.append(
            [
                label,
                f"{r['g_min']:.1f}",
                f"{r['textbook']:.1%}",
                f"{r['pivoted']:.1%}",
                "yes" if r["finite"] else "**no**",
                "-" if r["rel_rms"] is None else f"{r['rel_rms']:.1e}",
                f"{r['chunk_seconds']:.2f}",
            ]
        )
    s = store.get("situ")
    situ_rows = [
        [f"{x:.0e}", f"{a:.4g}", f"{b:.4g}", f"{c:.4g}", f"{d:.4g}"]
        for x, a, b, c, d in zip(
            s["x"],
            s["situ_float32_1"],
            s["situ_float32_-1"],
            s["swiglu_float32_1"],
            s["swiglu_bfloat16_1"],
            strict=True,
        )
    ]
    scale_rows = [
        [sc, f"{a:.3g}", f"{b:.3g}", f"{c:.2%}", f"{d:.2%}"]
        for sc, a, b, c, d in zip(
            s["scales"], s["situ_max"], s["swiglu_max"], s["situ_over_fp8"], s["swiglu_over_fp8"], strict=True
        )
    ]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    consts = [store.get(f"kda/{T}/const{d}") for d in DECAYS]
    steep = [-d for d in DECAYS]
    ax.plot(steep, [100 * r["textbook"] for r in consts], "o-", label="textbook split e^G·e^-G (64-token chunk)")
    ax.plot(steep, [100 * r["pivoted"] for r in consts], "s-", label="k3 pivoted split (halving, factors ≤ 1)")
    ax.axvline(5, color="grey", ls=":", lw=0.8)
    ax.text(5.2, 50, "K3's bound", color="grey")
    ax.set(
        xscale="log",
        xlabel="-g per token (decay steepness)",
        ylabel="% of in-chunk products inf/NaN (fp32)",
        title=f"KDA chunk products, T = {T:,}",
    )
    ax.legend()
    bx.plot(s["scales"], s["situ_max"], "o-", label="SiTU-GLU (β1=4, β2=25)")
    bx.plot(s["scales"], s["swiglu_max"], "s-", label="SwiGLU")
    bx.axhline(FP8_MAX, color="grey", ls=":", lw=0.8)
    bx.text(1, FP8_MAX * 1.3, "FP8 E4M3 max (448)", color="grey")
    bx.set(
        xscale="log",
        yscale="log",
        xlabel="input scale s (g, u ~ N(0, s²))",
        ylabel="max |output|, 1M samples",
        title="gated activation under growing inputs",
    )
    bx.legend()
    save_figure(fig, out / f"{NAME}.png")
    write_tables(
        out,
        [
            (
                f"(a) KDA in fp32, T = {T:,}, H = 1, K = V = 16, seed 0",
                [
                    "log-decay g",
                    "min g",
                    "textbook split: products inf/NaN",
                    "k3 pivoted split: inf/NaN",
                    "chunk_kda finite",
                    "rel. RMS error vs fp64 recurrence",
                    "chunk_kda seconds",
                ],
                rows,
            ),
            (
                "(b) SiTU-GLU vs SwiGLU at g = u = x",
                ["x", "abs SiTU, fp32", "abs SiTU at g = u = -x", "abs SwiGLU, fp32", "abs SwiGLU, bf16"],
                situ_rows,
            ),
            (
                "(b) g, u ~ N(0, s²), 10⁶ samples, seed 0",
                ["s", "max abs SiTU", "max abs SwiGLU", "SiTU beyond 448", "SwiGLU beyond 448"],
                scale_rows,
            ),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
