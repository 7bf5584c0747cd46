"""The serving dtype by capability: what `--dtype auto` chooses on this machine, what bf16 costs in the logits
of a trained model, and what it gains in the compiled engine's speed, fp32 and bf16 side by side in one run.

    python benchmarks/serving_dtype.py                         # the quickstart's model, if there is one
    python benchmarks/serving_dtype.py --model runs/quickstart --markdown

(a) the choice: k3.ops.compute_dtype's measured fp32 and bf16 matmul rates and its verdict.
(b) numerics: the model (--model, a run or model folder: `k3 quickstart` writes runs/quickstart) in fp32 and in
    bf16 over --batches × 256 validation tokens of its run folder (random tokens for a model folder): the
    largest and mean |Δ logit|, the mean |Δ log p| of the next token, top-1 agreement, the loss of each.
(c) speed: the small preset (random weights, trained-like KDA gates) in the engine with the compiled step, fp32
    and bf16: decode ms/token for one sequence after a 1K prefill, and 32 requests × 256 prompt / 64 output
    tokens in output tokens/s; medians of rounds alternating the dtypes.
"""

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from k3 import K3Config, K3Model
from k3.formats.tokenizer import byte_tokenizer
from k3.hub import load_pretrained
from k3.ops.compute_dtype import matmul_rates, resolve_dtype
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gates import trained_like_gates
from machine import cpu as cpu_name

TOK = byte_tokenizer()


def numerics(path: Path, batches: int) -> dict:
    """fp32 against bf16 logits of the model at `path` on validation tokens."""
    fp32 = load_pretrained(path, dtype=torch.float32).model
    bf16 = load_pretrained(path, dtype=torch.bfloat16).model
    run = path if (path / "val_tokens.npy").exists() else path.parent
    T = 256
    if (run / "val_tokens.npy").exists():
        tokens = torch.from_numpy(np.load(run / "val_tokens.npy")[: batches * (T + 1)].astype(np.int64))
        source = f"{run / 'val_tokens.npy'}"
    else:
        tokens = torch.randint(
            0, fp32.config.vocab_size, (batches * (T + 1),), generator=torch.Generator().manual_seed(0)
        )
        source = "random tokens"
    ids = tokens.view(batches, T + 1)
    rows = {"max_dlogit": 0.0, "sum_dlogit": 0.0, "sum_dlogp": 0.0, "agree": 0, "n": 0, "loss32": 0.0, "loss16": 0.0}
    with torch.no_grad():
        for b in range(batches):
            x, y = ids[b : b + 1, :-1], ids[b : b + 1, 1:]
            a = fp32(x).logits.double()[0]
            c = bf16(x).logits.double()[0]
            d = (a - c).abs()
            rows["max_dlogit"] = max(rows["max_dlogit"], d.max().item())
            rows["sum_dlogit"] += d.mean().item() * T
            la, lc = a.log_softmax(-1), c.log_softmax(-1)
            rows["sum_dlogp"] += (la.gather(1, y.T) - lc.gather(1, y.T)).abs().sum().item()
            rows["agree"] += (a.argmax(-1) == c.argmax(-1)).sum().item()
            rows["loss32"] -= la.gather(1, y.T).sum().item()
            rows["loss16"] -= lc.gather(1, y.T).sum().item()
            rows["n"] += T
    n = rows["n"]
    return {
        "source": source,
        "tokens": n,
        "max_dlogit": rows["max_dlogit"],
        "mean_dlogit": rows["sum_dlogit"] / n,
        "mean_dlogp": rows["sum_dlogp"] / n,
        "top1": rows["agree"] / n,
        "loss32": rows["loss32"] / n,
        "loss16": rows["loss16"] / n,
    }


def engine(model: K3Model) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=64, max_batched_tokens=4096)
    return LLMEngine(model, TOK, EngineConfig(memory_budget=256 << 20, enable_prefix_caching=False, scheduler=sched))


def run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds to run every prompt to completion (greedy, exactly max_tokens each)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    start = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - start


def decode_ms(eng: LLMEngine, prompt: list[int], steps: int) -> float:
    """Median ms per decode step of one sequence after its prefill."""
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    eng.step()  # the prefill (one 2K-token chunk)
    times = []
    while eng.has_unfinished():
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def speed(rounds: int) -> dict:
    config = K3Config.from_preset("small")
    torch.manual_seed(0)
    model = K3Model(config).eval()
    trained_like_gates(model, torch.randint(0, config.vocab_size, (4, 256)))
    models = {"float32": model, "bfloat16": K3Model(config).eval()}
    models["bfloat16"].load_state_dict(model.state_dict())
    models["bfloat16"].to(torch.bfloat16)
    engines = {name: engine(m) for name, m in models.items()}
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, config.vocab_size, (256,), generator=g).tolist() for _ in range(32)]
    long = torch.randint(0, config.vocab_size, (1024,), generator=g).tolist()
    warm = {}
    for name, eng in engines.items():  # compile each graph, outside the timings
        start = time.perf_counter()
        run(eng, batch[:2], 4)
        warm[name] = time.perf_counter() - start
    out = {name: {"tput": [], "decode": [], "warm_s": warm[name]} for name in engines}
    for _ in range(rounds):
        for name, eng in engines.items():
            out[name]["tput"].append(32 * 64 / run(eng, batch, 64))
            out[name]["decode"].append(decode_ms(eng, long, 24))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/quickstart", help="a run or model folder (default: %(default)s)")
    p.add_argument("--batches", type=int, default=8, help="validation sequences of 256 tokens for (b)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    fp32_rate, bf16_rate = matmul_rates()
    choice = resolve_dtype("auto")
    print(f"{datetime.date.today()}, {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"(a) --dtype auto chooses {choice}")
    lines = []
    model = Path(args.model)
    if model.exists():
        n = numerics(model, args.batches)
        print(f"(b) numerics on {model} ({n['tokens']} tokens of {n['source']})", flush=True)
        lines += [
            "| quantity | fp32 ↔ bf16 |",
            "|---|---|",
            f"| largest abs. logit difference | {n['max_dlogit']:.4f} |",
            f"| mean abs. logit difference | {n['mean_dlogit']:.4f} |",
            f"| mean abs. difference of the next token's log p | {n['mean_dlogp']:.4f} |",
            f"| top-1 agreement | {100 * n['top1']:.2f}% |",
            f"| loss, fp32 / bf16 | {n['loss32']:.4f} / {n['loss16']:.4f} |",
            "",
        ]
    else:
        print(f"(b) skipped: no model at {model} (run `k3 quickstart`, or pass --model)")
    print("(c) speed, the compiled engine", flush=True)
    sp = speed(args.rounds)
    med = {name: {k: statistics.median(v) for k, v in d.items() if k != "warm_s"} for name, d in sp.items()}
    lines += [
        "| dtype | first steps s (compile) | decode ms/token, batch 1, 1K context | output tok/s, 32 × 256 / 64 |",
        "|---|---|---|---|",
    ]
    for name in sp:
        lines.append(f"| {name} | {sp[name]['warm_s']:.1f} | {med[name]['decode']:.1f} | {med[name]['tput']:.0f} |")
    ratio_d = med["float32"]["decode"] / med["bfloat16"]["decode"]
    ratio_t = med["bfloat16"]["tput"] / med["float32"]["tput"]
    lines.append("")
    lines.append(f"bf16 ÷ fp32 speed: batch-1 decode {ratio_d:.2f}×, throughput {ratio_t:.2f}×")
    if args.markdown:
        print(
            f"\n{datetime.date.today()}, {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
            f"measured matmul (64 × 1024 × 1024): fp32 {fp32_rate:.0f}, bf16 {bf16_rate:.0f} GFLOP/s; "
            f"`--dtype auto` → {choice}; medians of {args.rounds} rounds; wall time "
            f"{time.perf_counter() - wall:.0f} s.\n"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
