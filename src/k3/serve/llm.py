"""The offline interface: `LLM(model=path).generate(prompts, SamplingParams(...))`, and a streaming iterator.

Both go through one AsyncEngine (its loop thread owns the engine), so streams and generate calls can be
interleaved, or run from several threads, each request reading only its own outputs.
"""

import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from k3.ops.compute_dtype import resolve_dtype
from k3.serve.async_engine import AsyncEngine, RequestHandle
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams, TokenLogprob
from k3.serve.scheduler import SchedulerConfig

log = logging.getLogger("k3.serve")


@dataclass
class Completion:
    request_id: str
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids when SamplingParams.logprobs is set


class LLM:
    """A model behind the engine: `LLM(path)` or `LLM(model=path)` (vLLM's spelling), where path is a model
    folder (config.json + safetensors, e.g. from `k3 export` or the release layout), a run folder (its
    newest checkpoint) or a step folder.

    memory_budget: bytes for the page pool (default 256 MiB), or num_pages: its size in pages.
    max_model_len: the context, prompt + max_tokens, a request may use (default max_position_embeddings).
    text_only: load a multimodal folder's language model, skipping the vision tower and projector.
    dtype: the model's dtype (float32 by default; folder tensors are converted to it): a torch.dtype, a name
    ("bfloat16", "float32", ...), or "auto": bf16 where this machine's bf16 matmuls measure ≥ 1.5× fp32's
    (k3.ops.compute_dtype; the choice and its reason are `LLM.dtype_choice`). KDA states stay fp32.
    quantization: None (default) holds every weight dense, decoding MXFP4-packed experts at load; "mxfp4"
    keeps the routed experts packed in memory and computes from them (a packed folder's bytes as they are;
    dense weights packed at load), 128/17 ≈ 7.5x fewer resident expert bytes than fp32.
    speculative_model: a draft folder from `k3 train-draft` (speculative decoding, docs/speculative.md): the
    draft proposes up to num_speculative_tokens (default: the draft's, 7) tokens a step and the model
    verifies them in its one forward; outputs follow the model's distribution exactly (greedy: the same tokens).
    spec_max_batch: speculate only while at most this many requests run (on a CPU a full batch is faster without).
    compile: run each engine step as one compiled graph (k3.serve.compiled_step); None (default) follows
    $K3_COMPILE (auto: wherever the model and machine allow it), False runs the eager reference.
    Other keywords go to SchedulerConfig. `ckpt=` is the older keyword for the path.

    The engine's step loop runs on a background thread (k3.serve.async_engine), started at the first
    request and stopped by close(), at `with LLM(...) as llm:`'s end, or when the LLM is garbage-collected.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        memory_budget: int | None = None,
        num_pages: int | None = None,
        enable_prefix_caching: bool = True,
        device: str = "cpu",
        text_only: bool = False,
        dtype: torch.dtype | str = torch.float32,
        quantization: str | None = None,
        ckpt: str | Path | None = None,
        max_model_len: int | None = None,
        speculative_model: str | Path | None = None,
        num_speculative_tokens: int | None = None,
        spec_max_batch: int | None = None,
        compile: bool | None = None,
        **scheduler_kwargs,
    ):
        from k3.hub import load_for_inference
        from k3.hub.load import check_quantization
        from k3.spec.folder import load_draft, read_meta

        if (model is None) == (ckpt is None):
            raise TypeError("LLM takes one model path: LLM(path), LLM(model=path) or LLM(ckpt=path)")
        check_quantization(quantization)  # before the scheduler's keywords and the (long) load
        self.dtype_choice = resolve_dtype(dtype, device)
        if dtype == "auto":
            log.info("k3: dtype %s", self.dtype_choice)
        if speculative_model is not None:
            read_meta(speculative_model)  # a missing or corrupt draft folder is reported before the load too
        if memory_budget is None and num_pages is None:
            memory_budget = 256 << 20
        config = EngineConfig(
            memory_budget=memory_budget,
            num_pages=num_pages,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len,
            num_speculative_tokens=num_speculative_tokens,
            spec_max_batch=spec_max_batch,
            compile=compile,
            scheduler=SchedulerConfig(**scheduler_kwargs),
        )
        weights, self.tokenizer = load_for_inference(
            model if ckpt is None else ckpt,
            device=device,
            dtype=self.dtype_choice.dtype,
            text_only=text_only,
            quantization=quantization,
        )
        draft = load_draft(speculative_model, weights) if speculative_model is not None else None
        self.engine = LLMEngine(weights, self.tokenizer, config, draft=draft)
        self.async_engine = AsyncEngine(self.engine)
        # the loop thread holds the engine, not this object: collecting the LLM stops the loop
        self._finalizer = weakref.finalize(self, self.async_engine.shutdown, 0)

    def close(self) -> None:
        """Abort what is still running and stop the engine's loop thread; the LLM takes no more requests."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self, prompts: str | list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run every prompt to completion, batched by the engine; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        handles: list[RequestHandle] = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                handles.append(self.async_engine.submit(p, sp))
            done = [self._collect(h, p) for h, p in zip(handles, prompts, strict=True)]
        except BaseException:
            # all or nothing: a bad prompt, an error or Ctrl-C leaves no request of this call in the engine
            _cancel_and_wait(handles)
            raise
        return done

    def _collect(self, handle: RequestHandle, prompt: str | list[int]) -> Completion:
        text, tokens, logprobs, out = [], [], None, None
        for out in handle:
            text.append(out.new_text)
            tokens += out.new_token_ids
            if out.logprobs is not None:
                logprobs = logprobs if logprobs is not None else []
                logprobs.extend(out.logprobs)
        if out.finish_reason == "error":
            raise RuntimeError(f"request {handle.request_id} failed in the engine: {out.error}")
        return Completion(
            handle.request_id,
            prompt,
            "".join(text),
            tokens,
            out.finish_reason,
            out.num_prompt_tokens,
            out.num_cached_tokens,
            logprobs,
        )

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it is generated. Other requests (other streams, generate calls)
        advance meanwhile, each with its own outputs; a consumer that stops early frees the request's pages."""
        handle = self.async_engine.submit(prompt, params)
        try:
            for out in handle:
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {handle.request_id} failed in the engine: {out.error}")
                if out.new_text:
                    yield out.new_text
        finally:
            _cancel_and_wait([handle])


CANCEL_WAIT_S = 60.0  # how long a cancelled request may take to be freed: the loop frees it after its current step


def _cancel_and_wait(handles: list[RequestHandle]) -> None:
    """Cancel the unfinished handles and wait until the engine has freed them, so that when the caller
    returns (or raises) none of its requests holds a page."""
    for handle in handles:
        handle.cancel()
    for handle in handles:
        handle.wait(CANCEL_WAIT_S)
