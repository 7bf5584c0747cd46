"""MXFP4/MXFP8 quantisation-aware training against full precision and post-training quantisation (issue 16).

    python benchmarks/qat.py --init-from RUN          # from a k3 run (the quickstart's): 40 steps of 4x256 each
    python benchmarks/qat.py --quick                  # the tiny preset from scratch on a made-up corpus, seconds

Two `k3 train` runs (k3.train.Trainer) start from the same weights (--init-from, or the same seeded init) and
see the same batches; their optimiser steps alternate, so their step times are measured side by side:
(a) full precision; (b) with `--qat mxfp4`. Then, on the same validation batches:
    (a) is served in fp32;
    (b) is exported with `k3 export --quantize mxfp4` and served from the packed folder
        (`quantization="mxfp4"`: MXFP4 experts, MXFP8 expert inputs, as trained);
    (c) is (a) quantised after training (round-to-nearest MXFP4 by the same export) and served the same way;
    (c') is (a) exported the same way but served with expert inputs unquantised (the release's weight-only
         MXFP4).
Greedy agreement: the fraction of validation positions where the served model's top-1 token is the one its
own unquantised forward (the same weights with expert_quantization None: (b)'s master weights, or (a))
picks, teacher-forced. Decode ms/token: the engine at batch 1 (greedy, prefix cache off), the models' steps
interleaved. Expert bytes: `k3.model.quantization.routed_expert_bytes` of the served models.
"""

import argparse
import copy
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3.formats.tokenizer import K3Tokenizer
from k3.hub import export_model, load_pretrained
from k3.model.quantization import routed_expert_bytes, set_expert_quantization
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.train.trainer import TrainArgs, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu as cpu_name


def trainers(args: argparse.Namespace, work: Path) -> dict[str, Trainer]:
    common = dict(
        preset=args.preset,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        eval_batches=args.eval_batches,
        eval_every=args.steps,
        ckpt_every=args.steps,
        seed=args.seed,
        data=args.data,
        vocab_size=args.vocab_size,
        init_from=args.init_from,
        progress=False,
    )
    if args.init_from is not None:  # continuing a trained model: a constant, low lr, no warmup
        common.update(lr=args.lr, warmup=0, min_lr_ratio=1.0)
    quiet = lambda *_: None  # noqa: E731
    return {
        name: Trainer(TrainArgs(out=str(work / name), qat=qat, **common), log=quiet)
        for name, qat in (("fp", None), ("qat", "mxfp4"))
    }


def train_side_by_side(runs: dict[str, Trainer], steps: int) -> dict[str, list[float]]:
    """Alternate the runs' optimiser steps (the order flips every step); returns each run's step seconds."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    tokens = next(iter(runs.values())).args
    for step in range(steps):
        for name in list(runs)[:: 1 if step % 2 == 0 else -1]:
            record = runs[name]._step(tokens.batch_size * tokens.seq_len * tokens.grad_accum)
            times[name].append(record["step_s"])
    for t in runs.values():
        t.save()
    return times


@torch.no_grad()
def evaluate(model, batches, reference=None) -> tuple[float, float | None]:
    """(mean validation loss, top-1 agreement with `reference` over every position, or None)."""
    losses, agree, total = [], 0, 0
    for batch in batches:
        out = model(batch, labels=batch)
        losses.append(out.loss.item())
        if reference is not None:
            agree += (out.logits.argmax(-1) == reference(batch).logits.argmax(-1)).sum().item()
            total += batch.numel()
    return sum(losses) / len(losses), (agree / total if reference is not None else None)


def decode_ms(models: dict[str, torch.nn.Module], tokenizer, new_tokens: int, rounds: int) -> dict[str, float]:
    """Median ms of a decode step at batch 1 after the prefill. Each model's engine holds one request, and
    their steps interleave (the order rotating each step), so a change of load reaches every model alike."""
    engines = {
        n: LLMEngine(m, tokenizer, EngineConfig(memory_budget=64 << 20, enable_prefix_caching=False))
        for n, m in models.items()
    }
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompt = tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(")
    samples: dict[str, list[float]] = {n: [] for n in models}
    names = list(engines)
    for _ in range(rounds):
        for engine in engines.values():
            engine.add_request(prompt, params)
            engine.step()  # the prefill (and the first token)
        for step in range(new_tokens - 1):
            for name in names[step % len(names) :] + names[: step % len(names)]:
                t0 = time.perf_counter()
                engines[name].step()
                samples[name].append(1000 * (time.perf_counter() - t0))
        assert not any(e.has_unfinished() for e in engines.values())
    return {n: statistics.median(v) for n, v in samples.items()}


def quick_corpus(work: Path) -> str:
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i in range(60):
        (corpus / f"m{i}.py").write_text("".join(f"def f_{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(8)))
    return str(corpus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--init-from", help="a run, step or model folder both runs start from (default: a seeded init)")
    p.add_argument("--preset", default="small")
    p.add_argument("--data", help="training text (default: the standard library, as k3 train)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4, help="with --init-from (constant); else k3 train's schedule")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny preset, 3 steps of 2x64, a made-up corpus")
    p.add_argument("--out", help="work folder (default: a temporary one)")
    args = p.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="k3-qat-"))
    if args.quick:
        args.preset, args.steps, args.batch_size, args.seq_len, args.vocab_size = "tiny", 3, 2, 64, 300
        args.eval_batches, args.new_tokens, args.rounds = 2, 8, 1
        args.data = args.data or quick_corpus(work)
    torch.manual_seed(args.seed)
    wall = time.perf_counter()
    runs = trainers(args, work)
    step_s = train_side_by_side(runs, args.steps)
    batches = runs["fp"].val_batches
    fp_run, qat_run = runs["fp"], runs["qat"]
    tokenizer = K3Tokenizer.load(work / "fp" / "tokenizer.json")

    fp = fp_run.model.eval()
    export_model(work / "qat", work / "qat-mxfp4", quantize="mxfp4")
    export_model(work / "fp", work / "fp-mxfp4", quantize="mxfp4")
    qat_packed = load_pretrained(work / "qat-mxfp4", quantization="mxfp4").model
    assert qat_packed.config.expert_quantization == "mxfp4"
    ptq_packed = load_pretrained(work / "fp-mxfp4", quantization="mxfp4").model
    ptq_weights_only = copy.deepcopy(ptq_packed)
    set_expert_quantization(ptq_packed, "mxfp4")
    qat_master = copy.deepcopy(qat_run.model.eval())
    set_expert_quantization(qat_master, None)  # (b)'s own unquantised forward
    rows = [
        ("(a) full precision, served fp32", fp, None),
        ("(b) QAT, served packed (MXFP4 W, MXFP8 in)", qat_packed, qat_master),
        ("(b) QAT master weights, unquantised", qat_master, None),
        ("(c) PTQ of (a), served packed (MXFP4 W, MXFP8 in)", ptq_packed, fp),
        ("(c') PTQ of (a), weight-only MXFP4", ptq_weights_only, fp),
    ]
    results = [(name, *evaluate(model, batches, ref), routed_expert_bytes(model)) for name, model, ref in rows]
    ms = decode_ms(
        {"fp32": fp, "mxfp4 W only": ptq_weights_only, "mxfp4 W + mxfp8 in": qat_packed},
        tokenizer,
        args.new_tokens,
        args.rounds,
    )
    wall = time.perf_counter() - wall

    tokens = args.steps * args.batch_size * args.seq_len
    start = f"--init-from {args.init_from}" if args.init_from else f"a seeded init (seed {args.seed})"
    print(
        f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, load average at the end "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}. Preset {args.preset}, from {start}, {args.steps} steps "
        f"of {args.batch_size}x{args.seq_len} ({tokens:,} tokens) per run, seed {args.seed}; validation "
        f"{len(batches)} batches ({sum(b.numel() for b in batches):,} tokens). Wall time {wall:.0f} s.\n"
    )
    print("| model | validation loss | greedy agreement with its unquantised forward | routed expert bytes |")
    print("|---|---|---|---|")
    for name, loss, agreement, nbytes in results:
        shown = "—" if agreement is None else f"{100 * agreement:.2f}%"
        print(f"| {name} | {loss:.4f} | {shown} | {nbytes:,} |")
    fp_bytes = results[0][3]
    print(f"\nExpert bytes fp32 / packed: {fp_bytes / results[1][3]:.2f}x.\n")
    med = {n: statistics.median(v) for n, v in step_s.items()}
    print("| | QAT off | QAT on | on / off |")
    print("|---|---|---|---|")
    print(
        f"| train step s (median of {args.steps}, alternating) | {med['fp']:.3f} | {med['qat']:.3f} | "
        f"{med['qat'] / med['fp']:.2f}x |"
    )
    print(
        f"| decode ms/token, batch 1 (median of {args.rounds} x {args.new_tokens - 1} interleaved steps; fp32 vs "
        f"packed W + MXFP8 in) | {ms['fp32']:.2f} | {ms['mxfp4 W + mxfp8 in']:.2f} | "
        f"{ms['mxfp4 W + mxfp8 in'] / ms['fp32']:.2f}x |"
    )
    print(
        f"| decode ms/token, weight-only packed (no MXFP8 inputs) | {ms['fp32']:.2f} | {ms['mxfp4 W only']:.2f} | "
        f"{ms['mxfp4 W only'] / ms['fp32']:.2f}x |"
    )


if __name__ == "__main__":
    main()
