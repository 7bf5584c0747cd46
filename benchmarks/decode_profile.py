"""What one engine decode step costs, counted: aten ops and bytes moved per step, and the top ops by
self time, for the small preset (random weights, fp32) at batch 1 and batch 64.

    python benchmarks/decode_profile.py                 # batch 1 at 1,024 tokens, batch 64 at 256
    python benchmarks/decode_profile.py --top 25 --steps 16 --threads 2
    python benchmarks/decode_profile.py --floor        # batch 1 only: ops by module, Llama's step, the eager floor

The op and byte counts are deterministic (the same code gives the same numbers on any machine, however
busy), so they are the before/after measure of a change to the decode path; the self times are one
profiled run and move with the machine's load. Counted per engine step (schedule, forward, sample),
every request decoding one token, none finishing.
"""

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from k3 import K3Config, K3Model
from k3.formats.tokenizer import byte_tokenizer
from k3.model.params import param_report
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig

# ops that only move data: their bytes are "bytes moved" (gathers, scatters, copies, concatenations)
MOVES = {
    "index",
    "index_select",
    "index_copy_",
    "index_copy",
    "index_put_",
    "copy_",
    "cat",
    "stack",
    "clone",
    "_to_copy",
    "gather",
    "scatter_",
    "contiguous",
    "expand_copy",
    "_unsafe_index_put",
    "index_add_",
}


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched (after autograd and composite decompositions) and the bytes the
    data-movement ops write."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.moved: Counter[str] = Counter()  # bytes written per data-movement op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in MOVES:
            # an in-place scatter writes its source's bytes, anything else its output's
            src = args[-1] if name in ("index_copy_", "index_copy", "index_add_") else out
            if name in ("index_put_", "_unsafe_index_put"):
                src = args[2]
            if name == "copy_":
                src = args[1]
            if isinstance(src, torch.Tensor):
                self.moved[name] += src.numel() * src.element_size()
            elif isinstance(src, (list, tuple)):
                self.moved[name] += sum(t.numel() * t.element_size() for t in src if isinstance(t, torch.Tensor))
        return out


def decoding_engine(model: K3Model, batch: int, context: int, seed: int = 0, compile: bool = False) -> LLMEngine:
    """An engine whose `batch` requests have each prefilled `context` tokens and decoded one: every
    later step is `batch` decode rows."""
    sched = SchedulerConfig(max_num_seqs=max(64, batch), max_batched_tokens=4096)
    eng = LLMEngine(
        model,
        byte_tokenizer(),
        EngineConfig(memory_budget=256 << 20, enable_prefix_caching=False, scheduler=sched, compile=compile),
    )
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(torch.randint(0, model.config.vocab_size, (context,), generator=gen).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.seqs.values()):
        eng.step()
    return eng


def measure(eng: LLMEngine, steps: int, top: int) -> dict:
    for _ in range(2):  # warm: scratch buffers and allocator caches at their steady size (and the graph compiled)
        eng.step()
    counter = OpCounter()
    if eng.runner.compiled is None:  # a dispatch mode sees the eager step's ops; a compiled graph runs without one
        with counter:
            eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    # operator calls the profiler saw per step: ATen ops and k3's operators (a compiled graph's fused kernels
    # run inside its one "CompiledFxGraph" event and are not counted)
    calls = Counter(
        {e.key: e.count // steps for e in prof.key_averages() if e.key.startswith(("aten::", "k3")) and e.count}
    )
    return dict(
        ops=counter.ops, moved=counter.moved, ms=1e3 * statistics.median(times), table=table, steps=steps, calls=calls
    )


# module kinds an op is charged to (the innermost enclosing one of these)
KINDS = (
    "KimiDeltaAttention",
    "GatedMLA",
    "Router",
    "GatedMLP",
    "LatentMoE",
    "RMSNorm",
    "DecoderLayer",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaRMSNorm",
    "LlamaDecoderLayer",
)
MATMULS = {
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "mv",
    "addmv",
    "matmul",
    "linear",
    "_scaled_dot_product_flash_attention_for_cpu",
}


def ops_by_module(model: torch.nn.Module, run) -> tuple[Counter, Counter]:
    """Aten ops of one run() charged to the innermost enclosing module of a kind in KINDS ("other" outside
    them), and the ops by name."""
    stack, per = ["other"], Counter()

    class Charged(OpCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            per[stack[-1]] += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    hooks = []
    for mod in model.modules():
        kind = type(mod).__name__
        if kind in KINDS:
            hooks.append(mod.register_forward_pre_hook(lambda m, a, kind=kind: stack.append(kind) and None))
            hooks.append(mod.register_forward_hook(lambda m, a, o: stack.pop() and None))
    counter = Charged()
    try:
        with counter:
            run()
    finally:
        for h in hooks:
            h.remove()
    return per, counter.ops


def op_cost_us(repeats: int = 20000) -> float:
    """Median µs of one tiny eager op (a 16-element add) called from Python: the floor of any op's cost."""
    x = torch.zeros(16)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            x.add(1.0)
        times.append((time.perf_counter() - t0) / repeats)
    return 1e6 * statistics.median(times)


def self_ms(run, steps: int) -> tuple[float, float, float]:
    """Median wall ms of run(), and the profiled self time per call in matmuls and in everything else."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    mm = other = 0.0
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            if e.key[len("aten::") :] in MATMULS:
                mm += e.self_cpu_time_total
            else:
                other += e.self_cpu_time_total
    return 1e3 * statistics.median(times), mm / 1e3 / steps, other / 1e3 / steps


def floor(model: K3Model, context: int, steps: int) -> None:
    """Batch-1 decode at `context`: k3's engine step and HF Llama's cached forward (same active parameters,
    benchmarks/train_step.py's llama_like) side by side: ops by module, matmul vs other self time, and the
    eager floor = matmul time + ops × the cost of the cheapest op."""
    from transformers import DynamicCache, LlamaForCausalLM

    from train_step import llama_like

    eng = decoding_engine(model, 1, context)
    for _ in range(2):
        eng.step()
    llama = LlamaForCausalLM(llama_like(param_report(model.config)["active"], model.config)).eval()
    cache = DynamicCache(config=llama.config)
    prompt = torch.randint(0, model.config.vocab_size, (1, context))
    with torch.no_grad():
        llama(prompt, cache=cache, use_cache=True)
    token = prompt[:, -1:]

    @torch.no_grad()
    def llama_step():
        llama(token, cache=cache, use_cache=True)

    unit = op_cost_us()
    print(f"\n## the eager floor, batch 1 at {context} tokens (cheapest op here: {unit:.2f} µs)")
    print(
        "| system | aten ops | of which matmuls | ms per step | matmul self ms | other self ms | "
        "floor ms (matmul + ops × cheapest op) |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for name, mod, run in (("k3 engine step", model, eng.step), ("Llama + KV cache", llama, llama_step)):
        per, ops = ops_by_module(mod, run)
        n, n_mm = sum(ops.values()), sum(c for o, c in ops.items() if o in MATMULS)
        ms, mm_ms, other_ms = self_ms(run, steps)
        rows[name] = (per, n)
        print(f"| {name} | {n:,} | {n_mm} | {ms:.1f} | {mm_ms:.1f} | {other_ms:.1f} | {mm_ms + n * unit / 1e3:.1f} |")
    for name, (per, _) in rows.items():
        print(f"\n{name}, ops by module: " + ", ".join(f"{k} {c}" for k, c in per.most_common()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="decode steps timed and profiled per batch size")
    p.add_argument("--top", type=int, default=15, help="rows of the self-time table")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context-1", type=int, default=1024, help="prompt tokens of the batch-1 request")
    p.add_argument("--context-64", type=int, default=256, help="prompt tokens of each batch-64 request")
    p.add_argument("--batches", default="1,64", help="comma-separated batch sizes (1 and/or 64)")
    p.add_argument("--floor", action="store_true", help="batch 1 only, next to HF Llama: ops by module, the floor")
    p.add_argument(
        "--compiled", action="store_true", help="also the compiled step (k3.serve.compiled_step): its operator calls"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = K3Model(K3Config.from_preset("small")).eval()
    print(f"k3 small, random weights, fp32, torch {torch.__version__}, {args.threads} thread(s)")
    if args.floor:
        floor(model, args.context_1, args.steps)
        return
    for batch in (int(b) for b in args.batches.split(",")):
        context = args.context_1 if batch == 1 else args.context_64
        if args.compiled:
            rows = []
            for compile in (False, True):
                r = measure(decoding_engine(model, batch, context, compile=compile), args.steps, args.top)
                rows.append((compile, sum(r["calls"].values()), r["calls"].most_common(6), r["ms"]))
            print(f"\n## batch {batch}, context {context}: operator calls per step seen by the profiler")
            for compile, total, top, ms in rows:
                what = "compiled" if compile else "eager"
                print(f"{what}: {total} calls, {ms:.1f} ms per step; " + ", ".join(f"{n} {c}" for n, c in top))
            continue
        r = measure(decoding_engine(model, batch, context), args.steps, args.top)
        total = sum(r["ops"].values())
        print(
            f"\n## batch {batch}, context {context}: {total} aten ops per step, "
            f"{sum(r['moved'].values()) / 1e6:.2f} MB moved by gathers/scatters/copies/cats, "
            f"{r['ms']:.1f} ms per step (median of {r['steps']}, noisy)"
        )
        print("ops per step: " + ", ".join(f"{n} {c}" for n, c in r["ops"].most_common(20)))
        print("MB moved per step: " + ", ".join(f"{n} {b / 1e6:.2f}" for n, b in r["moved"].most_common(8)))
        print(f"\nself time over {r['steps']} profiled steps:\n{r['table']}")


if __name__ == "__main__":
    main()
