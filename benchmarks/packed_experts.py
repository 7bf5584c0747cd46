"""MXFP4 experts in the engine: the same model served with its routed experts dense fp32 and MXFP4-packed.

    python benchmarks/packed_experts.py              # small preset, 3 rounds of 32 decode steps at batch 1 and 8
    python benchmarks/packed_experts.py --markdown   # also print the header line for docs/benchmarks.md

The small preset with random weights (`k3 init`) is exported with `k3 export --quantize mxfp4` to a temporary
folder, then served through the engine (`LLM`): decoded to dense fp32 weights at load (the default), and with
`quantization="mxfp4"` (the packed bytes kept as they are), both with the compiled step (`k3 serve`'s default;
the packed experts run k3_cpu::moe_experts_mxfp4, which reads the bytes in place), and the packed model once
more with the eager step (each active expert dequantised per forward by PyTorch ops). All compute from the same
unpack(pack(w)) weights, so their greedy tokens must be identical; the run checks it.
Columns: resident bytes of the routed experts' weights (`k3.model.quantization.routed_expert_bytes`) and of all weights,
load time, and decode tokens/s after the prefill (greedy, every request exactly --new-tokens tokens, prefix
cache off), medians of rounds that alternate the two models.
"""

import argparse
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch

from k3.cli import main as k3
from k3.hub import export_model
from k3.model.quantization import routed_expert_bytes, routed_expert_numel
from k3.serve.llm import LLM
from k3.serve.sampling import SamplingParams
from machine import cpu as cpu_name

# (name, LLM's quantization, its compile): the engine's default step (compiled, k3.serve.compiled_step) for both
# storages, and the eager step of the packed model, whose experts are dequantised per call by PyTorch ops
SYSTEMS = [
    ("dense fp32", None, True),
    ("MXFP4-packed", "mxfp4", True),
    ("MXFP4-packed, eager step", "mxfp4", False),
]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor in the state_dict (a tied tensor counted once)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    return sum(seen.values())


def decode(llm: LLM, batch: int, prompt_tokens: int, new_tokens: int) -> tuple[float, list[list[int]]]:
    """(decode tokens/s after the prefill, each request's tokens) for `batch` requests added at once."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [[3 + (31 * i + 7 * j) % 256 for j in range(prompt_tokens)] for i in range(batch)]
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids

    while not all(tokens.values()):  # prefill (its first token included) is not timed
        step()
    done = sum(map(len, tokens.values()))
    start = time.perf_counter()
    while engine.has_unfinished():
        step()
    seconds = time.perf_counter() - start
    return (sum(map(len, tokens.values())) - done) / seconds, [tokens[i] for i in ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batches", default="1,8", help="comma-separated request counts decoded at once")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per request (decode steps + 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    wall = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        run, folder = Path(tmp) / "run", Path(tmp) / "model"
        assert k3(["init", "--preset", args.preset, "--out", str(run)]) == 0
        export_model(run, folder, quantize="mxfp4")
        folder_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        systems, load_s, warm_s = {}, {}, {}
        for name, quantization, compile in SYSTEMS:
            start = time.perf_counter()
            systems[name] = LLM(
                model=str(folder),
                quantization=quantization,
                enable_prefix_caching=False,
                memory_budget=64 << 20,
                compile=compile,
            )
            load_s[name] = time.perf_counter() - start
            decode(systems[name], 2, 8, 4)  # warm-up: the compiled step's graph is built at its first step
            warm_s[name] = time.perf_counter() - start - load_s[name]

    rates: dict[tuple[str, int], list[float]] = {key: [] for key in ((s, b) for s in systems for b in batches)}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            for name, llm in systems.items():
                rate, tokens = decode(llm, batch, args.prompt_tokens, args.new_tokens)
                rates[name, batch].append(rate)
                outputs.setdefault((name, batch), tokens)
                assert outputs[name, batch] == tokens, "greedy decoding changed between rounds"
    identical = all(outputs["dense fp32", b] == outputs[name, b] for name in systems for b in batches)

    dense_model = systems["dense fp32"].engine.model
    fp32_experts = 4 * routed_expert_numel(dense_model)
    head = ["routed experts held as", "resident expert bytes", "fp32 ÷ this", "all weights, bytes", "load s"]
    head.append("first step s (compile)")
    head += [f"decode tok/s, batch {b}" for b in batches]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, llm in systems.items():
        model = llm.engine.model
        experts = routed_expert_bytes(model)
        row = [
            name,
            f"{experts:,}",
            f"{fp32_experts / experts:.2f}×",
            f"{weight_bytes(model):,}",
            f"{load_s[name]:.2f}",
            f"{warm_s[name]:.1f}",
        ]
        row += [f"{statistics.median(rates[name, b]):.1f}" for b in batches]
        lines.append("| " + " | ".join(row) + " |")
    ratio = {
        name: [statistics.median(rates[name, b]) / statistics.median(rates["dense fp32", b]) for b in batches]
        for name in systems
        if name != "dense fp32"
    }

    config = dense_model.config
    if args.markdown:
        print(
            f"{datetime.date.today()}, {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}. "
            f"Preset {args.preset} ({config.num_hidden_layers - config.first_k_dense_replace} MoE layers × "
            f"{config.num_experts} experts, top-{config.num_experts_per_token}), random weights exported with "
            f"`--quantize mxfp4` ({folder_bytes:,} bytes of safetensors); prompts of {args.prompt_tokens} tokens, "
            f"{args.new_tokens} greedy tokens each, medians of {args.rounds} rounds.\n"
        )
    print("\n".join(lines))
    print()
    for name, slow in ratio.items():
        speed = ", ".join(f"batch {b}: {r:.2f}" for b, r in zip(batches, slow, strict=True))
        print(f"{name} ÷ dense decode speed: {speed}")
    met = all(r >= 0.9 for r in ratio["MXFP4-packed"])
    verdict = "met" if met else "NOT met"
    print(f"goal (issue 29): the packed model's compiled step ≥ 0.9× dense at every batch: {verdict}")
    print(f"greedy tokens identical (dense vs packed, every system and batch): {'yes' if identical else 'NO'}")
    print(f"wall time {time.perf_counter() - wall:.0f} s")
    if not identical:
        raise SystemExit("the packed model's greedy tokens differ from the dense-decoded model's")


if __name__ == "__main__":
    main()
