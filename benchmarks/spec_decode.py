"""Speculative decoding, side by side in one run (issue 15): the engine without a draft and with each draft.

    python benchmarks/spec_decode.py --model /tmp/k3spec/quickstart \
        --draft alpha=/tmp/k3spec/draft_alpha --draft kl=/tmp/k3spec/draft_kl --draft block=/tmp/k3spec/draft_block
    python benchmarks/spec_decode.py --quick      # seconds: the tiny preset, untrained drafts (a smoke run)

Prompts are 8 windows of the run's validation tokens (val_tokens.npy); outputs are greedy (and, for the
acceptance table, also sampled at temperature 1). Each configuration keeps one engine across rounds, warmed
up first, so a compiled step (the default where the machine allows it; --no-compile for the eager one) is
traced before the timings. Batch 1: the first 4 prompts one after another; batch 8:
all 8 together. Every configuration generates the same requests; rounds alternate the configurations so a
shared machine's load hits each alike, and the median round is reported. Greedy outputs with a draft are
checked to be the tokens without one.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.speculative.stats import SpecStats


def load(args) -> tuple[torch.nn.Module, dict, np.ndarray]:
    """(big model, {name: draft}, validation tokens)."""
    if args.quick:
        from k3 import K3Config, K3Model
        from k3.spec.draft import DraftModel

        torch.manual_seed(0)
        model = K3Model(K3Config.from_preset("tiny")).eval()
        drafts = {"chain": DraftModel(model.config), "block": DraftModel(model.config, mode="block")}
        return model, drafts, np.random.default_rng(0).integers(0, 500, 5000)
    from k3.hub import load_for_inference
    from k3.spec.folder import load_draft

    model, _ = load_for_inference(args.model)
    drafts = {}
    for spec in args.draft:
        name, _, path = spec.partition("=")
        drafts[name] = load_draft(path, model)
    folder = Path(args.model)
    val = next((p for p in (folder / "val_tokens.npy", folder.parent / "val_tokens.npy") if p.is_file()), None)
    if val is None:
        sys.exit(f"no val_tokens.npy in {folder} or its parent")
    return model, drafts, np.load(val)


def new_engine(model, draft, rollback="snapshot", k=None, compile=None) -> LLMEngine:
    """An engine for one configuration, kept across rounds: a compiled step is traced once per engine."""
    config = EngineConfig(
        memory_budget=96 << 20,
        enable_prefix_caching=False,
        spec_rollback=rollback,
        num_speculative_tokens=k,
        compile=compile,
    )
    return LLMEngine(model, None, config, draft=draft)


def generate(engine: LLMEngine, prompts, params) -> tuple[float, list[list[int]], SpecStats]:
    """Seconds to finish every request (all added at once), their tokens, and the speculation's statistics."""
    engine.spec_stats = SpecStats()
    ids = [engine.add_request(p, params) for p in prompts]
    out = {i: [] for i in ids}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return time.perf_counter() - t0, [out[i] for i in ids], engine.spec_stats


def merged(all_stats: list[SpecStats]) -> SpecStats:
    out = SpecStats()
    for s in all_stats:
        out = out + s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="runs/quickstart", help="the big model (a run, step or model folder)")
    ap.add_argument("--draft", action="append", default=[], metavar="NAME=DIR", help="a draft folder (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny preset, untrained drafts, few tokens")
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engines' step: compiled, eager, or (default) as $K3_COMPILE says (auto: compiled where it can)",
    )
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.rounds = 12, 1
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, drafts, val = load(args)
    rng = np.random.default_rng(1)
    starts = rng.integers(0, len(val) - args.prompt_tokens, 8)
    prompts = [[int(t) for t in val[s : s + args.prompt_tokens]] for s in starts]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    first = next(iter(drafts))
    configs = [
        ("none", None, "snapshot", None),
        *[(n, d, "snapshot", None) for n, d in drafts.items()],
        (f"{first}, replay rollback", drafts[first], "replay", None),
        (f"{first}, k = 3", drafts[first], "snapshot", 3),
    ]
    engines = {name: new_engine(model, draft, rollback, k, args.compile) for name, draft, rollback, k in configs}
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for engine in engines.values():  # the compiled step's graphs are built here, outside the timings
        generate(engine, prompts[:2], warm)
    step = "compiled" if next(iter(engines.values())).runner.compiled is not None else "eager"
    print(f"load average {os.getloadavg()[0]:.2f}; {args.max_tokens} new tokens per request, greedy, {step} step")
    print("| draft | batch | tokens/s | × none | tokens/verify step | acceptance per position |")
    print("|---|---|---|---|---|---|")
    for batch, groups in ((1, [[p] for p in prompts[:4]]), (8, [prompts])):
        times = {c[0]: [] for c in configs}
        results = {}
        for _ in range(args.rounds):
            for name, *_ in configs:
                runs = [generate(engines[name], group, greedy) for group in groups]
                times[name].append(sum(r[0] for r in runs))
                results[name] = ([t for r in runs for t in r[1]], merged([r[2] for r in runs]))
        ref_tokens = results["none"][0]
        n_tokens = sum(map(len, groups)) * args.max_tokens
        base = n_tokens / statistics.median(times["none"])
        for name, *_ in configs:
            tokens, stats = results[name]
            assert tokens == ref_tokens, f"{name}: greedy tokens differ from decoding without a draft"
            rate = n_tokens / statistics.median(times[name])
            per_pos = " ".join(f"{a:.2f}" for a in stats.acceptance_at()) if stats.verify_steps else "-"
            tps = f"{stats.tokens_per_step:.2f}" if stats.verify_steps else "1"
            print(f"| {name} | {batch} | {rate:.1f} | {rate / base:.2f}× | {tps} | {per_pos} |", flush=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    print("\nsampled at temperature 1, batch 8 (acceptance only)")
    print("| draft | tokens/verify step | acceptance per position |")
    print("|---|---|---|")
    for name in drafts:
        stats = generate(engines[name], prompts, sampled)[2]
        print(f"| {name} | {stats.tokens_per_step:.2f} | {' '.join(f'{a:.2f}' for a in stats.acceptance_at())} |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
