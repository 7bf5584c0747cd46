"""Would fused C++ element-wise kernels pay (issue 30 item 2)? k3's eager training pieces against Inductor's fused
C++ kernels for the same formulas, forward + backward, at the small preset's shapes of one 8 × 256 training step.

    python benchmarks/elementwise_fusion.py            # 2 threads, 9 rounds
    python benchmarks/elementwise_fusion.py --threads 1 --rounds 5

Per piece, the work of one step (every call the step makes, in one timed loop):
- SiTU-GLU: 8 MoE layers × (routed experts' (4096, 256) + shared expert's (2048, 256)), the dense layer's (2048, 768);
- gated RMSNorm: 6 KDA layers × (8, 256, 4, 64) with its sigmoid gate;
- AttnRes: the 18 sublayer inputs and the readout, each over its 2–4 sources of (8, 256, 256);
- cross-entropy: (2048, 8192) logits.

"k3 eager" is what `k3 train` runs: each piece's hand-written autograd Function over ATen's vectorised kernels.
"Inductor fused" is `torch.compile(reference formula, dynamic=False)`: Inductor writes one C++ loop per fusion
group, forward and backward, which is what a hand-written fused kernel would be, so its time bounds what item 2
could gain. Inputs are made outside the timed region; rounds alternate the two.
"""

import argparse
import statistics
import time

import torch

from k3.model.attn_res import attn_res, attn_res_reference
from k3.model.gated_norm import gated_rms_norm, gated_rms_norm_reference
from k3.model.norm import RMSNorm
from k3.model.situ import situ, situ_reference
from k3.ops.cross_entropy import cross_entropy
from k3.ops.cross_entropy import reference as cross_entropy_reference
from machine import cpu

SITU_SHAPES = [(4096, 256), (2048, 256)] * 8 + [(2048, 768)]
ATTN_RES_SOURCES = [1 + layer // 3 + (layer % 3 > 0 or sub > 0) for layer in range(9) for sub in (0, 1)] + [4]


def situ_calls():
    return [(torch.randn(s) * 3, torch.randn(s) * 3) for s in SITU_SHAPES]


def norm_calls():
    return [(torch.randn(8, 256, 4, 64), 1 + 0.1 * torch.randn(64), torch.randn(8, 256, 4, 64)) for _ in range(6)]


def attn_res_calls():
    return [[torch.randn(8, 256, 256) for _ in range(s)] for s in ATTN_RES_SOURCES if s > 1]


def loss_calls():
    return [(torch.randn(2048, 8192) * 2, torch.randint(0, 8192, (2048,)))]


def run_pieces(fast: bool, compiled: dict) -> dict:
    """One step's worth of each piece, forward + backward: name -> seconds."""
    proj, norm = torch.nn.Linear(256, 1, bias=False), RMSNorm(256, 1e-5)
    with torch.no_grad():
        proj.weight.normal_(0, 0.1)
    out = {}
    for name, make, call in (
        ("SiTU-GLU", situ_calls, lambda g, u: (situ if fast else compiled["situ"])(g, u)),
        ("gated RMSNorm", norm_calls, lambda x, w, g: (gated_rms_norm if fast else compiled["norm"])(x, w, g, 1e-5)),
        ("AttnRes", attn_res_calls, lambda *v: (attn_res if fast else compiled["attn_res"])(list(v), proj, norm)),
        ("cross-entropy", loss_calls, lambda x, t: (cross_entropy if fast else compiled["loss"])(x, t)),
    ):
        calls = [[t.requires_grad_() if t.is_floating_point() and t.dim() > 1 else t for t in args] for args in make()]
        start = time.perf_counter()
        for args in calls:
            y = call(*args)
            y.backward(torch.ones_like(y))
        out[name] = time.perf_counter() - start
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    compiled = {
        "situ": torch.compile(situ_reference, dynamic=False),
        "norm": torch.compile(gated_rms_norm_reference, dynamic=False),
        "attn_res": torch.compile(attn_res_reference, dynamic=False),
        "loss": torch.compile(cross_entropy_reference, dynamic=False),
    }
    for fast in (True, False, True, False):  # compile every shape, warm both
        run_pieces(fast, compiled)
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for fast in (True, False) if r % 2 == 0 else (False, True):
            for name, t in run_pieces(fast, compiled).items():
                times.setdefault(name, {}).setdefault("k3" if fast else "inductor", []).append(t)
    print(f"# {cpu()}, {args.threads} threads, medians of {args.rounds} rounds; ms per 8 x 256 step, fwd + bwd\n")
    print("| piece | k3 eager (ms) | Inductor fused (ms) | k3 / fused |")
    print("|---|---|---|---|")
    total = {"k3": 0.0, "inductor": 0.0}
    for name, t in times.items():
        k3, fused = (statistics.median(t[k]) * 1e3 for k in ("k3", "inductor"))
        total["k3"] += k3
        total["inductor"] += fused
        print(f"| {name} | {k3:.1f} | {fused:.1f} | {k3 / fused:.2f}× |")
    print(f"| all four | {total['k3']:.1f} | {total['inductor']:.1f} | {total['k3'] / total['inductor']:.2f}× |")


if __name__ == "__main__":
    main()
