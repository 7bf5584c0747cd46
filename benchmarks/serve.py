"""Online serving benchmark, like vLLM's `bench serve`: Poisson arrivals at a few rates against `k3 serve`
run as a subprocess on loopback (as a user runs it: its own process and interpreter lock; SSE streaming read
with httpx), and the same arrivals submitted in-process to
k3.LLM's engine (no HTTP), so the difference is the server's overhead.

    python benchmarks/serve.py                    # small preset, 48 requests per rate, rates 2, 4, 8, inf
    python benchmarks/serve.py --quick            # tiny preset, 24 requests, rates 4, 16, inf
    python benchmarks/serve.py --markdown         # also print the header for docs/benchmarks.md

Each request: P prompt tokens (distinct random bytes, so the prefix cache does not help), exactly O output
tokens (greedy, ignore_eos). `inf` sends every request at once: saturation. Per rate and side: TTFT (send to
first streamed text), TPOT ((last - first) / (tokens - 1)), ITL (gaps between streamed chunks; a chunk is
usually one token, two when a byte-level token ends inside a UTF-8 character), p50 and p99, output tokens/s
over the run (first send to last token), and goodput: requests/s that met both SLOs (--slo-ttft, --slo-tpot).
Bounded: --requests per rate, and each rate stops sending after --max-seconds.
"""

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from k3.cli import main as k3_main
from k3.serve.llm import LLM
from k3.serve.sampling import SamplingParams

NUM_PAGES = 4000
MAX_NUM_SEQS = 64


@dataclass
class Result:
    sent_s: float
    first_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    tokens: int = 0


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at `rate` requests/s; all 0 for rate inf."""
    if rate == float("inf"):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(n)]  # printable bytes, byte tokenizer


async def http_run(
    url: str, model: str, reqs: list[list[int]], times: list[float], out_tokens: int, max_seconds: float
) -> tuple[list[Result], float]:
    results: list[Result] = []
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def one(prompt: list[int], at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            r = Result(time.perf_counter())
            results.append(r)
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": out_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    now = time.perf_counter()
                    if event.get("usage"):
                        r.tokens = event["usage"]["completion_tokens"]
                    elif event["choices"] and event["choices"][0]["text"]:
                        r.first_s = r.first_s or now
                        r.chunk_s.append(now)

        await asyncio.gather(*(one(p, t) for p, t in zip(reqs, times, strict=True) if t <= max_seconds))
    return results, start


async def engine_run(
    llm: LLM, reqs: list[list[int]], times: list[float], out_tokens: int, max_seconds: float
) -> tuple[list[Result], float]:
    results: list[Result] = []
    start = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)

    async def one(prompt: list[int], at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        r = Result(time.perf_counter())
        results.append(r)
        handle = await llm.async_engine.submit_async(prompt, params)
        async for out in handle:
            now = time.perf_counter()
            if out.new_text:
                r.first_s = r.first_s or now
                r.chunk_s.append(now)
            r.tokens = out.num_output_tokens

    await asyncio.gather(*(one(p, t) for p, t in zip(reqs, times, strict=True) if t <= max_seconds))
    return results, start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def summarise(results: list[Result], start: float, slo_ttft: float, slo_tpot: float) -> dict:
    done = [r for r in results if r.first_s is not None and r.tokens > 1]
    ttft = [r.first_s - r.sent_s for r in done]
    tpot = [(r.chunk_s[-1] - r.first_s) / (r.tokens - 1) for r in done]
    itl = [b - a for r in done for a, b in zip(r.chunk_s, r.chunk_s[1:], strict=False)]
    span = max(r.chunk_s[-1] for r in done) - start
    good = sum(1 for a, b in zip(ttft, tpot, strict=True) if a <= slo_ttft and b <= slo_tpot)
    return {
        "n": len(done),
        "ttft": ttft,
        "tpot": tpot,
        "itl": itl,
        "tok_s": sum(r.tokens for r in done) / span,
        "goodput": good / span,
        "good": good,
    }


def row(rate: float, side: str, s: dict) -> str:
    ms = lambda v: f"{1000 * v:,.0f}"  # noqa: E731
    rate_text = "inf" if rate == float("inf") else f"{rate:g}"
    p50_p99 = lambda key: f"{ms(pct(s[key], 50))} / {ms(pct(s[key], 99))}"  # noqa: E731
    return (
        f"| {rate_text} | {side} | {s['n']} | {p50_p99('ttft')} | {p50_p99('tpot')} | {p50_p99('itl')} | "
        f"{s['tok_s']:,.1f} | {s['goodput']:.2f} ({s['good']}/{s['n']}) |"
    )


@contextmanager
def k3_serve(folder: Path, max_model_len: int):
    """`k3 serve` in a subprocess on a free loopback port; yields its base URL once /health answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "k3.cli",
        "serve",
        "--model",
        str(folder),
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--num-pages",
        str(NUM_PAGES),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-model-len",
        str(max_model_len),
        "--max-n",
        "1",
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"k3 serve did not start: {' '.join(command)}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--rates", default=None, help="comma-separated requests/s; inf = all at once")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--max-seconds", type=float, default=60.0, help="stop sending after this many s per rate")
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="s (default 2)")
    ap.add_argument("--slo-tpot", type=float, default=0.25, help="s per output token (default 0.25)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    preset = args.preset or ("tiny" if args.quick else "small")
    n = args.requests or (24 if args.quick else 48)
    rates = [float(r) for r in (args.rates or ("4,16,inf" if args.quick else "2,4,8,inf")).split(",")]
    torch.manual_seed(args.seed)

    folder = Path(tempfile.mkdtemp(prefix="k3-bench-serve-")) / "model"
    assert k3_main(["init", "--preset", preset, "--out", str(folder), "--seed", str(args.seed)]) == 0
    llm = LLM(folder, num_pages=NUM_PAGES, max_num_seqs=MAX_NUM_SEQS)
    vocab = llm.engine.model.config.vocab_size

    header = (
        "| rate (req/s) | path | requests | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
        "output tok/s | goodput (req/s, met SLO) |\n|---|---|---|---|---|---|---|---|"
    )
    lines = []
    with k3_serve(folder, args.prompt_tokens + args.output_tokens + 1) as url:
        warm = prompts(4, args.prompt_tokens, vocab, seed=-1)
        asyncio.run(http_run(url, "bench", warm, [0.0] * 4, args.output_tokens, 10))  # first-call costs, both sides
        asyncio.run(engine_run(llm, warm, [0.0] * 4, args.output_tokens, 10))
        for k, rate in enumerate(rates):
            reqs = prompts(n, args.prompt_tokens, vocab, seed=args.seed + k)
            times = arrivals(n, rate, args.seed + k)
            server = summarise(
                *asyncio.run(http_run(url, "bench", reqs, times, args.output_tokens, args.max_seconds)),
                args.slo_ttft,
                args.slo_tpot,
            )
            offline = summarise(
                *asyncio.run(engine_run(llm, reqs, times, args.output_tokens, args.max_seconds)),
                args.slo_ttft,
                args.slo_tpot,
            )
            lines += [row(rate, "server (HTTP)", server), row(rate, "k3.LLM (in-process)", offline)]
            overhead = 100 * (offline["tok_s"] / server["tok_s"] - 1)
            print(
                lines[-2] + "\n" + lines[-1] + f"\n    server overhead in output tok/s at rate {rate:g}: "
                f"{overhead:+.1f}%",
                file=sys.stderr,
                flush=True,
            )
    llm.close()
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    if args.markdown:
        print(
            f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
            f"threads, torch {torch.__version__}, load average {load} at the end; preset {preset}, "
            f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens, {n} requests per rate, "
            f"SLOs TTFT <= {args.slo_ttft} s and TPOT <= {1000 * args.slo_tpot:.0f} ms\n"
        )
    print(header)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
