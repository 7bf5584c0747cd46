"""`k3 generate` and `k3 eval`: a model folder or run prompted from the shell, or scored on text."""

import argparse
import json
import os
import sys
from pathlib import Path

from k3.cli.common import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, USER_ERRORS, _device, _fail
from k3.cli.image_generation import image_prompt, load_images
from k3.config import K3Config


def cmd_generate(args: argparse.Namespace) -> int:
    """Continue a prompt with a checkpoint, through the serving engine."""
    mid_line = [False]  # a streamed line is unfinished on the terminal: Ctrl-C's message starts a new one
    try:
        return _generate(args, mid_line)
    except KeyboardInterrupt:
        print(("\n" if mid_line[0] else "") + "k3 generate: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    """The reader of stdout closed it early. Python ignores SIGPIPE and raises BrokenPipeError instead; the
    remedy its docs give: point stdout at /dev/null, so the flush at exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (captured in a test): nothing to flush
        pass
    return EXIT_BROKEN_PIPE


def _generate(args: argparse.Namespace, mid_line: list[bool]) -> int:
    from k3.serve.llm import LLM
    from k3.serve.sampling import SamplingParams

    try:
        prompt = _read_prompt(args.prompt)
        pictures = load_images(getattr(args, "image", None) or [])  # a bad image is refused before the load
        if args.n < 1:
            raise ValueError(f"-n {args.n}: the number of completions is at least 1")
        device = _device(args.device)
        _check_context(args.ckpt, prompt, args.max_tokens, args.max_model_len)  # before the weights are read
        # one request per completion; a seed s gives completion i the seed s + i, so they differ yet repeat
        params = [
            SamplingParams(
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                max_tokens=args.max_tokens,
                stop=tuple(args.stop or ()),
                seed=None if args.seed is None else args.seed + i,
            )
            for i in range(args.n)
        ]
        budget = None if args.memory_budget is None else int(args.memory_budget * (1 << 20))
        llm = LLM(
            args.ckpt,
            memory_budget=budget,
            num_pages=args.num_pages,
            text_only=args.text_only,
            quantization=args.quantization,
            device=device,
            compile=args.compile,
            dtype=args.dtype,
        )
        if args.dtype == "auto":
            print(f"k3 generate: dtype {llm.dtype_choice}", file=sys.stderr)
        request = image_prompt(llm, pictures, prompt) if pictures else prompt  # token ids with the images
        if args.verbose:
            print(llm.engine.describe(), file=sys.stderr)
        if args.quantization == "mxfp4":
            print(_packed_experts_line(llm.engine.model), file=sys.stderr)
        if args.stream:
            for i, sp in enumerate(params):
                _completion_header(i, args.n)
                print(prompt, end="", flush=True)
                mid_line[0] = True
                for text in llm.stream(request, sp):
                    print(text, end="", flush=True)
                print()
                mid_line[0] = False
        else:
            for i, out in enumerate(llm.generate([request] * args.n, params)):
                _completion_header(i, args.n)
                print(prompt + out.text)
    except USER_ERRORS as e:
        return _fail("generate", e)
    return 0


def _completion_header(i: int, n: int) -> None:
    if n > 1:
        print(f"--- completion {i + 1} of {n} ---", flush=True)


def _read_prompt(arg: str) -> str:
    """The prompt argument, or all of stdin for "-"."""
    prompt = sys.stdin.read() if arg == "-" else arg
    if not prompt:
        raise ValueError("the prompt is empty" + (" (stdin gave nothing)" if arg == "-" else ""))
    return prompt


def _peek(path: str) -> tuple[K3Config, Path | None]:
    """A model's config and its tokenizer.json (None if absent), without reading any weights."""
    from k3.formats.checkpoint import load_checkpoint
    from k3.hub import folder_kind

    if folder_kind(path) == "model folder":
        config, tokenizer = K3Config.from_hf(path), Path(path) / "tokenizer.json"
    else:
        # the full load verifies the checksums and reports a fallback to an older step: no second report here
        ckpt = load_checkpoint(path, check_digests=False, log=lambda message: None)
        config, tokenizer = ckpt.config, ckpt.path.parent / ckpt.state.get("tokenizer", "tokenizer.json")
    return config, tokenizer if tokenizer.is_file() else None


def _check_context(path: str, prompt: str, max_tokens: int, max_model_len: int | None) -> None:
    """Refuse a prompt whose tokens plus max_tokens exceed the model's context (max_position_embeddings, or
    the smaller --max-model-len) before the weights are read."""
    from k3.formats.tokenizer import K3Tokenizer

    config, tokenizer = _peek(path)
    limit, source = config.max_position_embeddings, "the model's max_position_embeddings"
    if max_model_len is not None:
        if max_model_len < 1:
            raise ValueError(f"--max-model-len {max_model_len}: must be at least 1")
        if max_model_len > limit:
            raise ValueError(f"--max-model-len {max_model_len} exceeds {source} ({limit:,})")
        limit, source = max_model_len, "--max-model-len"
    if max_tokens > limit:  # --max-tokens alone too long: said even without a tokenizer to count the prompt
        raise ValueError(f"--max-tokens {max_tokens:,} exceeds the context of {limit:,} tokens ({source})")
    if tokenizer is None:
        return  # the load names the missing tokenizer
    n = len(K3Tokenizer.load(tokenizer).encode(prompt))
    if n + max_tokens > limit:
        raise ValueError(
            f"the prompt's {n:,} tokens + --max-tokens {max_tokens:,} = {n + max_tokens:,} exceed the context of "
            f"{limit:,} tokens ({source}); shorten the prompt or lower --max-tokens"
        )


def _packed_experts_line(model) -> str:
    from k3.model.quantization import routed_expert_bytes, routed_expert_numel

    packed, fp32 = routed_expert_bytes(model), 4 * routed_expert_numel(model)
    return (
        f"routed experts: MXFP4-packed, {packed / (1 << 20):.2f} MiB resident ({fp32 / packed:.2f}x less than "
        f"fp32's {fp32 / (1 << 20):.2f} MiB)"
    )


def cmd_eval(args: argparse.Namespace) -> int:
    """Perplexity (and nats per token) of a model on a text file or a folder of them."""
    from k3.eval import evaluate
    from k3.eval_lengths import check_pairs

    try:
        check_pairs(args.task, args.pairs)
    except ValueError as e:
        return _fail("eval", e)
    if args.task is not None:
        return _eval_lengths(args)
    try:
        if args.data is None:
            raise ValueError("--data is needed for perplexity (or pass --task to score by context length)")
        device = _device(args.device)
        result = evaluate(
            args.model,
            args.data,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            device=device,
            text_only=args.text_only,
        )
    except KeyboardInterrupt:
        print("k3 eval: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except USER_ERRORS as e:
        return _fail("eval", e)
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    skipped = [f"{n} {what}" for n, what in ((result.not_utf8, "not UTF-8 text"), (result.empty, "empty")) if n]
    print(
        f"perplexity {result.perplexity:.3f} ({result.nats_per_token:.4f} nats/token) over {result.tokens:,} "
        f"tokens of {result.files:,} file{'s' if result.files != 1 else ''}"
        + (f" (skipped: {', '.join(skipped)})" if skipped else "")
        + f"; windows of {result.seq_len} tokens; model {result.model}"
    )
    return 0


def _eval_lengths(args: argparse.Namespace) -> int:
    """`k3 eval --task ... --lengths ...`: one row per length as it finishes, or one JSON object at the end."""
    from k3.eval_lengths import describe, evaluate_lengths, parse_lengths

    def show(result) -> None:
        print(describe(result), flush=True)

    try:
        results = evaluate_lengths(
            args.model,
            args.task,
            parse_lengths(args.lengths),
            examples=args.examples,
            batch_size=args.batch_size,
            chunk_tokens=args.chunk_tokens,
            data=args.data,
            device=_device(args.device),
            text_only=args.text_only,
            pairs=args.pairs,
            log=None if args.json else show,
        )
    except KeyboardInterrupt:
        print("k3 eval: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except USER_ERRORS as e:
        return _fail("eval", e)
    if args.json:
        print(json.dumps({"model": str(args.model), "task": args.task, "results": [r.as_dict() for r in results]}))
    return 0
