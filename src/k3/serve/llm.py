"""The offline interface: `LLM(model=path).generate(prompts, SamplingParams(...))`, and a streaming iterator."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig


@dataclass
class Completion:
    request_id: str
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int


class LLM:
    """A model behind the engine: `LLM(path)` or `LLM(model=path)` (vLLM's spelling), where path is a model
    folder (config.json + safetensors, e.g. from `k3 export` or the release layout), a run folder (its
    newest checkpoint) or a step folder.

    memory_budget: bytes for the page pool (default 256 MiB), or num_pages: its size in pages.
    text_only: load a multimodal folder's language model, skipping the vision tower and projector.
    dtype: the model's dtype (float32 by default; folder tensors are converted to it).
    quantization: None (default) holds every weight dense, decoding MXFP4-packed experts at load; "mxfp4"
    keeps the routed experts packed in memory and computes from them (a packed folder's bytes as they are;
    dense weights packed at load), 128/17 ≈ 7.5x fewer resident expert bytes than fp32.
    Other keywords go to SchedulerConfig. `ckpt=` is the older keyword for the path.
    """

    def __init__(self, model: str | Path | None = None, memory_budget: int | None = None,
                 num_pages: int | None = None, enable_prefix_caching: bool = True, device: str = "cpu",
                 text_only: bool = False, dtype: torch.dtype = torch.float32, quantization: str | None = None,
                 ckpt: str | Path | None = None, **scheduler_kwargs):  # fmt: skip
        from k3.hub import load_for_inference
        from k3.hub.load import check_quantization

        if (model is None) == (ckpt is None):
            raise TypeError("LLM takes one model path: LLM(path), LLM(model=path) or LLM(ckpt=path)")
        check_quantization(quantization)  # before the scheduler's keywords and the (long) load
        if memory_budget is None and num_pages is None:
            memory_budget = 256 << 20
        config = EngineConfig(memory_budget=memory_budget, num_pages=num_pages,
                              enable_prefix_caching=enable_prefix_caching,
                              scheduler=SchedulerConfig(**scheduler_kwargs))  # fmt: skip
        weights, self.tokenizer = load_for_inference(model if ckpt is None else ckpt, device=device, dtype=dtype,
                                                     text_only=text_only, quantization=quantization)  # fmt: skip
        self.engine = LLMEngine(weights, self.tokenizer, config)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:  # fmt: skip
        """Run every prompt to completion, batched by the engine; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(p, sp))
        except Exception:
            for request_id in ids:  # all or nothing: a bad prompt leaves no earlier one queued
                self.engine.abort(request_id)
            raise
        done: dict[str, Completion] = {}
        texts = {i: [] for i in ids}
        tokens = {i: [] for i in ids}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                texts[out.request_id].append(out.new_text)
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    done[out.request_id] = Completion(
                        out.request_id, None, "".join(texts[out.request_id]), tokens[out.request_id],
                        out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens,
                    )  # fmt: skip
        return [Completion(**{**done[i].__dict__, "prompt": p}) for i, p in zip(ids, prompts, strict=True)]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it is generated (other queued requests advance too)."""
        request_id = self.engine.add_request(prompt, params)
        try:
            while True:
                finished = False
                for out in self.engine.step():
                    if out.request_id == request_id:
                        if out.new_text:
                            yield out.new_text
                        finished = out.finished
                if finished or request_id not in self.engine.seqs:
                    return
        finally:
            self.engine.abort(request_id)  # a consumer that stops early frees the request's pages
