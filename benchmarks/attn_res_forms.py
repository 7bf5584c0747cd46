"""Block AttnRes at inference: k3's one form against the two it replaced, in one run, alternating.

    python benchmarks/attn_res_forms.py            # the engine's decode step (small preset) and one sublayer
    python benchmarks/attn_res_forms.py --rounds 60 --threads 1

Forms, each giving a sublayer's input from the completed blocks and the partial sum:
- "one form" (k3.model.attn_res today): the training forward, with each completed block's 1/rms computed
  once per block (AttnResStream._block_inv_rms); bitwise the training forward.
- "stacked" (the form removed in issue 27, kept here as the peer): the completed blocks stacked once per
  block with their 1/rms, then one matmul, softmax and weighted sum over the stack; taken for <= 256 tokens
  at inference. Another summation order: ulps from training, one E4M3 step in QAT logits (docs/quantization.md).
- "per source": the training forward as is, every 1/rms recomputed for every sublayer.

Engine: the small preset (random weights, AttnRes queries as a trained model has them, not zero), fp32, every
request decoding; each round runs one engine step per form, in an order that rotates, and the table gives
medians. Sublayer: one AttnRes input over S sources at K3's width, the per-block work done beforehand.
"""

import argparse
import os
import statistics
import time

import torch
from torch import nn

from k3 import K3Config, K3Model
from k3.formats.tokenizer import byte_tokenizer
from k3.model import attn_res as attn_res_module
from k3.model import model as model_module
from k3.model.norm import RMSNorm
from k3.ops.numerics import at_least_fp32
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig
from machine import cpu


class PerSourceStream(attn_res_module.AttnResStream):
    """attn_res over the sources with nothing kept between sublayers."""

    def input(self, query):
        return attn_res_module.attn_res(self.blocks if self.partial is None else [*self.blocks, self.partial], *query)

    readout = input


class StackedStream(attn_res_module.AttnResStream):
    """The removed inference form, as it was in k3.model.attn_res before issue 27."""

    def input(self, query):
        x, single = self.blocks[0], len(self.blocks) == 1 and self.partial is None
        if single or torch.is_grad_enabled() or x.shape[0] * x.shape[1] > 256:
            return PerSourceStream.input(self, query)
        proj, norm = query
        stacked = getattr(self, "_stacked", None)
        if stacked is None or len(stacked[0]) != len(self.blocks) or stacked[2] != norm.eps:
            stack = torch.stack(self.blocks)
            sf = at_least_fp32(stack)
            self._stacked = stack, torch.rsqrt(sf.pow(2).mean(-1) + norm.eps), norm.eps
        stack, inv_rms, _ = self._stacked
        sf = at_least_fp32(stack)
        wg = (proj.weight[0] * norm.weight).to(sf.dtype)
        logits = (sf @ wg) * inv_rms  # (S, B, T)
        if self.partial is not None:
            pf = at_least_fp32(self.partial)
            last = (pf @ wg) * torch.rsqrt(pf.pow(2).mean(-1) + norm.eps)
            logits = torch.cat([logits, last[None]])
        weights = torch.softmax(logits, dim=0).to(stack.dtype)
        out = (stack * weights[: len(stack), ..., None]).sum(0)
        if self.partial is not None:
            out = torch.addcmul(out, self.partial, weights[-1, ..., None])
        return out

    readout = input


FORMS = {"one form": attn_res_module.AttnResStream, "stacked": StackedStream, "per source": PerSourceStream}


def trained_like(model: K3Model) -> K3Model:
    """AttnRes pseudo-queries as training leaves them (not the zero init, which weights every source equally)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0, 0.05)
    return model


def decoding_engine(model: K3Model, batch: int, context: int, max_tokens: int) -> LLMEngine:
    """`batch` requests that have prefilled `context` random tokens: every later step is `batch` decode rows."""
    scheduler = SchedulerConfig(max_num_seqs=max(64, batch), max_batched_tokens=4096)
    config = EngineConfig(memory_budget=512 << 20, enable_prefix_caching=False, scheduler=scheduler)
    eng = LLMEngine(model, byte_tokenizer(), config)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(torch.randint(0, model.config.vocab_size, (context,), generator=gen).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.seqs.values()):
        eng.step()
    return eng


def engine_step_ms(batch: int, context: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = trained_like(K3Model(K3Config.from_preset("small"))).eval()
    eng = decoding_engine(model, batch, context, max_tokens=3 * rounds + 8)
    for _ in range(2):
        eng.step()
    times: dict[str, list[float]] = {name: [] for name in FORMS}
    names = list(FORMS)
    try:
        for i in range(rounds):
            for name in names[i % 3 :] + names[: i % 3]:
                model_module.AttnResStream = FORMS[name]
                t0 = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t0)
    finally:
        model_module.AttnResStream = attn_res_module.AttnResStream
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def sublayer_us(S: int, N: int, d: int, rounds: int) -> dict[str, float]:
    """One sublayer input over S sources (S − 1 completed blocks and a partial sum) of N tokens at width d."""
    torch.manual_seed(0)
    proj, norm = nn.Linear(d, 1, bias=False), RMSNorm(d)
    nn.init.normal_(proj.weight, std=0.05)
    blocks, partial = [torch.randn(1, N, d) for _ in range(S - 1)], torch.randn(1, N, d)
    times: dict[str, list[float]] = {name: [] for name in FORMS}
    with torch.no_grad():
        for _ in range(rounds):
            for name, form in FORMS.items():
                stream = form(blocks[0], set())
                stream.blocks, stream.partial = list(blocks), partial
                stream.input((proj, norm))  # the per-block work, done once per block in a forward
                t0 = time.perf_counter()
                for _ in range(4):
                    stream.input((proj, norm))
                times[name].append((time.perf_counter() - t0) / 4)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    header = " | ".join(FORMS)
    print(f"\n| engine step, small preset (median ms) | {header} |\n|---|---|---|---|")
    for batch, context in ((1, 1024), (64, 256)):
        ms = engine_step_ms(batch, context, args.rounds)
        print(f"| batch {batch} at {context} tokens | " + " | ".join(f"{v:.2f}" for v in ms.values()) + " |")
    print(f"\n| one sublayer input (median µs) | {header} |\n|---|---|---|---|")
    for S, N, d in ((4, 1, 256), (4, 64, 256), (10, 1, 7168), (10, 64, 7168)):
        us = sublayer_us(S, N, d, 5 * args.rounds if d < 1024 else args.rounds)
        print(f"| S = {S}, {N} token(s), d = {d} | " + " | ".join(f"{v:.1f}" for v in us.values()) + " |")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
