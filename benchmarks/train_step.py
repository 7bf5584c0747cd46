"""Training-step benchmark: the small K3 preset next to HF transformers' LlamaForCausalLM with the same
number of active parameters, trained by the same loop (forward, backward, clip, MuonAdamW step; K3
also runs its Quantile Balancing update, which is part of its step).

    python benchmarks/train_step.py               # batches of 8 and 32 × 256 tokens, fp32, 2 threads
    python benchmarks/train_step.py --markdown    # also print the table for docs/benchmarks.md
    python benchmarks/train_step.py --k3-expert-optimizer muon adamw   # one K3 row per routed-expert optimiser
    python benchmarks/train_step.py --kda kernel reference   # K3 with KDA's C++ CPU kernel and its PyTorch reference
    python benchmarks/train_step.py --compile off on --llama-compile off on --dtype float32 bfloat16
                                                  # eager and compiled steps, fp32 and bf16 autocast, both models

MFU = model FLOPs per token × tokens/s ÷ the fp32 matmul rate measured in this run, with model
FLOPs = 3 × the forward FLOPs (forward + backward): 2 per active matmul weight, plus attention over
the average context (seq_len / 2) and, for K3, the KDA state updates (k3.model.params).
"""

import argparse
import datetime
import itertools
import os
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gates import trained_like_gates
from k3 import K3Config, K3Model
from k3.model.params import param_report
from k3.ops.compile_cache import use_inductor_cache
from k3.ops.kda import cpu_kernel
from k3.train.balance import QuantileBalancer
from k3.train.compiled import IdleExperts, compile_training
from k3.train.optim import build_optimizer
from machine import cpu


def matmul_gflops(repeats: int = 5) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * 2048**3 / statistics.median(times) / 1e9


def llama_like(k3_active: int, config: K3Config) -> LlamaConfig:
    """A conventional Llama (MLP width 3·d, as SwiGLU models use) with K3-small's width, heads,
    vocabulary and untied head; the layer count, then the MLP width in steps of 64, chosen so its
    parameter count comes closest to K3-small's active parameters."""
    d = config.hidden_size

    def count(layers: int, inter: int) -> int:
        return 2 * config.vocab_size * d + d + layers * (4 * d * d + 3 * d * inter + 2 * d)

    layers = min(range(1, 33), key=lambda n: abs(count(n, 3 * d) - k3_active))
    inter = min(range(2 * d, 4 * d + 1, 64), key=lambda i: abs(count(layers, i) - k3_active))
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=d,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )


def llama_flops_per_token(c: LlamaConfig, context: int) -> int:
    """Forward: 2 per matmul weight (input embedding excluded), plus q·kᵀ and p·v over `context` tokens."""
    d, L = c.hidden_size, c.num_hidden_layers
    weights = L * (4 * d * d + 3 * d * c.intermediate_size) + c.vocab_size * d
    return 2 * weights + L * 2 * 2 * d * context


def bench(
    model, batch: torch.Tensor, steps: int, balancer=None, forward=None, dtype="float32", **optimizer_args
) -> tuple[float, float]:
    """Median seconds per training step, and the median share of it spent in the optimiser. `forward` is what
    runs the micro-batch (the model, or it compiled); dtype "bfloat16" runs it under bf16 autocast, as
    `k3 train --dtype bfloat16` does."""
    forward = model if forward is None else forward
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, **optimizer_args)
    idle = IdleExperts(model) if forward is not model and balancer is not None else None
    step_s, opt_s = [], []
    for i in range(steps + 1):  # the first step warms up allocators and caches
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            out = forward(batch, labels=batch)
        out.loss.backward()
        if balancer is not None:
            balancer.observe(out.routing)
        if idle is not None:
            idle.observe(out.routing)
            idle.release()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if balancer is not None:
            balancer.update()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if i:
            step_s.append(t2 - t0)
            opt_s.append(t2 - t1)
    return statistics.median(step_s), statistics.median(opt_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, nargs="+", default=[8, 32], help="sequences per step (one row each)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the table shows medians")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--k3-expert-optimizer",
        nargs="+",
        default=["muon"],
        choices=["muon", "muon-active", "adamw"],
        help="K3's routed-expert optimiser (k3 train --expert-optimizer); one K3 row for each",
    )
    p.add_argument(
        "--kda",
        nargs="+",
        default=["kernel"],
        choices=["kernel", "reference"],
        help="the chunked KDA op on the CPU: the C++ kernel (default) or the PyTorch reference "
        "(K3_KDA_CPU_KERNEL=off); one K3 row for each",
    )
    p.add_argument(
        "--k3-muon-dtype",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="the dtype of K3's Newton-Schulz iterations (k3 train --muon-dtype); one K3 row for each",
    )
    p.add_argument(
        "--compile",
        nargs="+",
        default=["off"],
        choices=["off", "on"],
        help="K3's step eager and/or compiled (k3 train --compile); one K3 row for each",
    )
    p.add_argument(
        "--llama-compile",
        nargs="+",
        default=["off"],
        choices=["off", "on"],
        help="Llama's step eager and/or under torch.compile; one Llama row for each",
    )
    p.add_argument(
        "--dtype",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="the compute dtype of both models (bfloat16: autocast over fp32 weights, k3 train --dtype); one row "
        "for each",
    )
    p.add_argument("--markdown", action="store_true")
    p.add_argument(
        "--gates",
        choices=["trained", "init"],
        default="trained",
        help="KDA gates: trained-like (g = −5·sigmoid(N(0,1)), the regime a trained model runs in; default) "
        "or as initialised (g ≈ 0, what earlier tables measured)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = K3Config.from_preset("small")
    report = param_report(config, context=args.seq_len // 2)
    k3_model = K3Model(config)
    gates = "KDA gates as initialised (g ≈ 0)"
    if args.gates == "trained":
        gates = trained_like_gates(k3_model, torch.randint(0, config.vocab_size, (4, 256)))
    print(gates)
    lcfg = llama_like(report["active"], config)
    llama = LlamaForCausalLM(lcfg)
    llama_params = sum(p.numel() for p in llama.parameters())
    k3_flops = 3 * report["flops_per_token"]["total"]
    llama_flops = 3 * llama_flops_per_token(lcfg, args.seq_len // 2)

    mm = matmul_gflops()
    print(
        f"train step, sequences of {args.seq_len}, fp32, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; fp32 matmul {mm:.1f} GFLOP/s"
    )
    print(
        f"K3 small: {report['total'] / 1e6:.2f}M parameters, {report['active'] / 1e6:.2f}M active; "
        f"Llama: {llama_params / 1e6:.2f}M ({lcfg.num_hidden_layers} layers, MLP {lcfg.intermediate_size})"
    )
    lines = [
        "| batch (tokens) | model | active params | train FLOPs/token | step ms | optimizer ms | tokens/s | MFU "
        "| K3 / Llama eager fp32 | K3 / Llama in the same mode |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    use_inductor_cache()
    # K3 compiled as `k3 train --compile` compiles it (deterministic scatter-adds; the table of 2026-12-03 evening
    # was measured with plain torch.compile, before that mode: docs/benchmarks.md)
    k3_compiled, llama_compiled = compile_training(k3_model), torch.compile(llama)
    k3_variants = list(
        itertools.product(args.k3_expert_optimizer, args.kda, args.k3_muon_dtype, args.compile, args.dtype)
    )
    llama_variants = list(itertools.product(args.llama_compile, args.dtype))
    for bs in args.batch_size:
        batch = torch.randint(0, config.vocab_size, (bs, args.seq_len))
        tokens = batch.numel()
        k3_runs = {v: [] for v in k3_variants}
        llama_runs = {v: [] for v in llama_variants}
        for r in range(args.rounds):  # alternate so drift on a shared machine hits every row alike
            for (algo, kda, ns, comp, dtype), runs in k3_runs.items():
                os.environ[cpu_kernel.ENV_VAR] = "off" if kda == "reference" else "auto"
                balancer = QuantileBalancer(k3_model)
                forward = k3_compiled if comp == "on" else k3_model
                runs.append(
                    bench(k3_model, batch, args.steps, balancer, forward, dtype, expert_optimizer=algo, ns_dtype=ns)
                )
            os.environ.pop(cpu_kernel.ENV_VAR)
            for (comp, dtype), runs in llama_runs.items():
                runs.append(bench(llama, batch, args.steps, None, llama_compiled if comp == "on" else llama, dtype))
            rates = [f"K3 {' '.join(v)} {tokens / rs[-1][0]:.0f}" for v, rs in k3_runs.items()]
            rates += [f"Llama {' '.join(v)} {tokens / rs[-1][0]:.0f}" for v, rs in llama_runs.items()]
            print(f"batch {bs}, round {r + 1} (tok/s): {', '.join(rates)}", flush=True)
        medians = {v: tuple(statistics.median(x[i] for x in rs) for i in (0, 1)) for v, rs in llama_runs.items()}
        ll_step = medians[("off", "float32")][0] if ("off", "float32") in medians else None
        rows = []
        for (algo, kda, ns, comp, dtype), runs in k3_runs.items():
            step, opt = (statistics.median(x[i] for x in runs) for i in (0, 1))
            name = "K3 small" + ("" if algo == "muon" else f", experts {algo}")
            name += "" if kda == "kernel" else ", KDA reference"
            name += "" if ns == "float32" else f", Newton-Schulz in {ns}"
            name += ", compiled" if comp == "on" else ""
            name += ", bf16 autocast" if dtype == "bfloat16" else ""
            ratio = f"{ll_step / step:.2f}×" if ll_step else ""
            same = f"{medians[(comp, dtype)][0] / step:.2f}×" if (comp, dtype) in medians else ""
            rows.append((name, report["active"], k3_flops, step, opt, f"{ratio} | {same}"))
        for (comp, dtype), (step, opt) in medians.items():
            name = "Llama (HF transformers)" + (", torch.compile" if comp == "on" else "")
            name += ", bf16 autocast" if dtype == "bfloat16" else ""
            rows.append((name, llama_params, llama_flops, step, opt, " | "))
        for name, params, flops, step, opt, ratio in rows:
            tps = tokens / step
            lines.append(
                f"| {bs} × {args.seq_len} ({tokens}) | {name} | {params / 1e6:.2f}M | {flops / 1e6:.1f}M "
                f"| {step * 1e3:.0f} | {opt * 1e3:.0f} | {tps:.0f} | {100 * flops * tps / (mm * 1e9):.1f}% "
                f"| {ratio} |"
            )
    print()
    print("\n".join(lines))
    if args.markdown:
        print(
            f"\n{datetime.date.today()}, {cpu()}, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}; fp32 matmul {mm:.1f} GFLOP/s; medians of {args.rounds} rounds × "
            f"{args.steps} steps; {gates}; chunked KDA: {cpu_kernel.describe()}"
        )


if __name__ == "__main__":
    main()
