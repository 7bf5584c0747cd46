"""The `k3` command line. Thin: each subcommand parses its flags and calls into the package."""

import argparse
import dataclasses
import json
import os
import platform
import sys
from pathlib import Path

import torch

import k3
from k3.config import PRESETS, ConfigError, K3Config
from k3.model.params import DEFAULT_CONTEXT, format_report, param_report


def cmd_env(args: argparse.Namespace) -> int:
    """What k3 will run on here: versions, threads, devices, and which KDA backend each device gets."""
    from k3.ops.kda.backend import ENV_VAR, describe, fla_kda, fla_version, fla_version_tested

    version = fla_version()
    if version is None:
        fla = "not installed (pip install 'k3[cuda]' on a CUDA machine)"
    elif not fla_version_tested(version):
        fla = f"{version}: untested, not used (k3 is tested with the range in pyproject's cuda extra)"
    else:
        fla = f"{version}: kernels " + ("importable" if fla_kda() is not None else "not importable (no Triton/GPU)")
    rows = [
        ("k3", k3.__version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("cpu threads", str(torch.get_num_threads())),
        ("cuda", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not available"),
        ("flash-linear-attention", fla),
        (ENV_VAR, os.environ.get(ENV_VAR, "unset (auto)")),
        ("KDA backend on cpu", describe("cpu")),
    ]
    if torch.cuda.is_available():
        rows.append(("KDA backend on cuda", describe("cuda")))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _context(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens (an integer >= 0)")
    return int(text)


def cmd_params(args: argparse.Namespace) -> int:
    """Parameters by component (total and active), FLOPs per token, MLA cache and KDA state sizes."""
    try:
        if args.config is None:
            config, source = K3Config.from_preset(args.preset or "k3"), f"preset {args.preset or 'k3'}"
        else:
            config, source = _config_of(Path(args.config)), args.config
    except (ValueError, OSError) as e:  # ConfigError and CheckpointError are ValueErrors
        print(f"k3 params: {e}", file=sys.stderr)
        return 2
    report = param_report(config, context=args.context)
    print(json.dumps(report, indent=2) if args.json else format_report(report, source))
    return 0


def _config_of(path: Path) -> K3Config:
    """The config of a config.json, a model folder, or a run or step folder (its meta.json; the tensors are
    not read)."""
    from k3.train.checkpoint import load_checkpoint

    if path.is_dir() and not (path / "config.json").exists():
        if (path / "meta.json").exists() or any(path.glob("step_*/meta.json")):
            return load_checkpoint(path, verify=False).config
        raise ConfigError(f"{path}: no config.json, and not a run or step folder (no meta.json)")
    return K3Config.from_hf(path)


QUICKSTART_PROMPT = "def fibonacci(n):\n"
QUICKSTART_STEPS = 120
USER_ERRORS = (ValueError, FileNotFoundError)  # ConfigError, CheckpointError, CorpusError are ValueErrors


def next_generate(run: str | Path) -> str:
    """The `k3 generate` line suggested after training: bash's $'...' quoting, so that the prompt holds a real
    newline rather than a backslash and an n; the run folder quoted for the shell."""
    import shlex

    return f"k3 generate --ckpt {shlex.quote(str(run))} --max-tokens 200 --stream $'import os\\n'"


def _fail(command: str, error: Exception) -> int:
    print(f"k3 {command}: {error}", file=sys.stderr)
    return 2


def _train_args(args: argparse.Namespace, **overrides):
    from k3.train.trainer import TrainArgs

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainArgs) if hasattr(args, f.name)}
    return TrainArgs(**{**values, **overrides})


RUN_ERRORS = (ValueError, OSError)  # user mistakes about a run: bad values, paths, a read-only folder


def _run_error(command: str, error: Exception) -> int:
    """One line for a user mistake; an OSError names its file rather than its errno."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        error = f"{error.filename}: {error.strerror}"
    return _fail(command, error)


def _rerun_command(args: argparse.Namespace, resume: bool, **changes) -> str:
    """The `k3 train`/`k3 quickstart` line that repeats this one (flags that differ from the defaults), with
    `changes` to its values."""
    import shlex

    from k3.train.trainer import TrainArgs

    defaults = vars(build_parser().parse_args([args.command, "--out", args.out]))
    parts = ["k3", args.command]
    for f in dataclasses.fields(TrainArgs):
        value = changes.get(f.name, getattr(args, f.name))
        if f.name in ("resume", "override") or (f.name != "out" and value == defaults[f.name]):
            continue
        if f.name == "progress":
            parts.append("--no-progress")
        elif isinstance(value, bool):
            if value:
                parts.append("--" + f.name.replace("_", "-"))
        else:
            parts += ["--" + f.name.replace("_", "-"), shlex.quote(str(value))]
    if resume and args.command == "train":
        parts.append("--resume")
    return " ".join(parts)


def _interrupted(command: str, args: argparse.Namespace, trainer) -> int:
    """Ctrl-C: where the run stood and the command that continues it; exit status 130 as a shell reports."""
    from k3.train.checkpoint import step_dirs

    step = 0 if trainer is None else trainer.step
    saved = None if trainer is None else trainer.saved_step
    if trainer is not None:
        # Ctrl-C can land after a checkpoint's folder is renamed into place but before the trainer notes it
        on_disk = [int(p.name.rsplit("_", 1)[1]) for p in step_dirs(trainer.run)]
        saved = max([s for s in (saved, *on_disk) if s is not None], default=None)
    if saved is None:
        print(f"\nk3 {command}: interrupted at step {step}, before the first checkpoint; start again with: "
              f"{_rerun_command(args, resume=False)}", file=sys.stderr)  # fmt: skip
    else:
        print(f"\nk3 {command}: interrupted at step {step}; resume with: {_rerun_command(args, resume=True)} "
              f"(continues from step {saved}, the last checkpoint)", file=sys.stderr)  # fmt: skip
    return EXIT_INTERRUPTED


def cmd_train(args: argparse.Namespace) -> int:
    """Train (or --resume) a K3 model; checkpoints, metrics.jsonl and tokenizer.json go to --out."""
    from k3.train.trainer import Trainer

    trainer = None
    try:
        trainer = Trainer(_train_args(args))
        summary = trainer.train()
    except KeyboardInterrupt:
        return _interrupted("train", args, trainer)
    except RUN_ERRORS as e:
        return _run_error("train", e)
    print(json.dumps({k: v for k, v in summary.items() if k != "maxvio"}))
    import shlex

    out, model = shlex.quote(args.out), shlex.quote(args.out.rstrip("/") + "-model")
    print(f"\nnext:\n  {next_generate(args.out)}\n"
          f"  k3 plot {out}    # loss.png and maxvio.png in the run folder\n"
          f"  {_rerun_command(args, resume=True, steps=2 * args.steps)}    # train twice as long\n"
          f"  k3 export --ckpt {out} --out {model}    # a model folder for k3, vLLM or SGLang")  # fmt: skip
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    """A randomly initialised checkpoint with a byte-level tokenizer: for tests and servers that need no training."""
    from k3.model import K3Model
    from k3.train.checkpoint import save_checkpoint, step_dirs
    from k3.train.optim import build_optimizer
    from k3.train.tokenizer import byte_tokenizer

    out = Path(args.out)
    try:
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file; a checkpoint folder is a directory (choose another --out)")
        if step_dirs(out):
            raise ValueError(f"{out} already holds checkpoints; choose a new --out")
        tokenizer = byte_tokenizer()
        config = K3Config.from_preset(args.preset, vocab_size=tokenizer.vocab_size)
        torch.manual_seed(args.seed)
        model = K3Model(config)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save(out / "tokenizer.json")
        state = {"position": 0, "tokenizer": "tokenizer.json", "init": {"preset": args.preset, "seed": args.seed}}
        path = save_checkpoint(out, 0, model, build_optimizer(model, lr=1e-3, weight_decay=0.0), config, state)
    except RUN_ERRORS as e:
        return _run_error("init", e)
    print(f"wrote {path} ({sum(p.numel() for p in model.parameters()):,} parameters, preset {args.preset})")
    return 0


EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout's reader went away (`k3 generate … | head -1`)


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
        if args.n < 1:
            raise ValueError(f"-n {args.n}: the number of completions is at least 1")
        device = _device(args.device)
        _check_context(args.ckpt, prompt, args.max_tokens, args.max_model_len)  # before the weights are read
        # one request per completion; a seed s gives completion i the seed s + i, so they differ yet repeat
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 max_tokens=args.max_tokens, stop=tuple(args.stop or ()),
                                 seed=None if args.seed is None else args.seed + i) for i in range(args.n)]  # fmt: skip
        budget = None if args.memory_budget is None else int(args.memory_budget * (1 << 20))
        llm = LLM(args.ckpt, memory_budget=budget, num_pages=args.num_pages, text_only=args.text_only,
                  quantization=args.quantization, device=device)  # fmt: skip
        if args.verbose:
            print(llm.engine.describe(), file=sys.stderr)
        if args.quantization == "mxfp4":
            print(_packed_experts_line(llm.engine.model), file=sys.stderr)
        if args.stream:
            for i, sp in enumerate(params):
                _completion_header(i, args.n)
                print(prompt, end="", flush=True)
                mid_line[0] = True
                for text in llm.stream(prompt, sp):
                    print(text, end="", flush=True)
                print()
                mid_line[0] = False
        else:
            for i, out in enumerate(llm.generate([prompt] * args.n, params)):
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


def _device(name: str) -> str:
    """A device torch can use here, checked before any loading: cpu, cuda or cuda:N."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: k3 runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: torch sees no CUDA device here (`k3 env` shows what it sees)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 ...)")
    return str(device)


def _peek(path: str) -> tuple[K3Config, Path | None]:
    """A model's config and its tokenizer.json (None if absent), without reading any weights."""
    from k3.hub import folder_kind
    from k3.train.checkpoint import load_checkpoint

    if folder_kind(path) == "model folder":
        config, tokenizer = K3Config.from_hf(path), Path(path) / "tokenizer.json"
    else:
        # the full load verifies the checksums and reports a fallback to an older step: no second report here
        ckpt = load_checkpoint(path, verify=False, log=lambda message: None)
        config, tokenizer = ckpt.config, ckpt.path.parent / ckpt.state.get("tokenizer", "tokenizer.json")
    return config, tokenizer if tokenizer.is_file() else None


def _check_context(path: str, prompt: str, max_tokens: int, max_model_len: int | None) -> None:
    """Refuse a prompt whose tokens plus max_tokens exceed the model's context (max_position_embeddings, or
    the smaller --max-model-len) before the weights are read."""
    from k3.train.tokenizer import K3Tokenizer

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
    from k3.quant import routed_expert_bytes, routed_expert_numel

    packed, fp32 = routed_expert_bytes(model), 4 * routed_expert_numel(model)
    return (
        f"routed experts: MXFP4-packed, {packed / (1 << 20):.2f} MiB resident ({fp32 / packed:.2f}x less than "
        f"fp32's {fp32 / (1 << 20):.2f} MiB)"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """An OpenAI-compatible HTTP server over the engine until SIGTERM or Ctrl-C (docs/serving.md)."""
    try:
        from k3.server.main import serve
    except ImportError as e:
        print(f"k3 serve: {e.name or e} is not installed; pip install 'k3[serve]'", file=sys.stderr)
        return 2

    limits = {"max_body_bytes": args.max_body_bytes, "max_tokens": args.max_tokens_limit, "max_n": args.max_n,
              "max_prompts": args.max_prompts, "drain_timeout_s": args.drain_timeout}  # fmt: skip
    try:
        device = _device(args.device)
        budget = None if args.memory_budget is None else int(args.memory_budget * (1 << 20))
        return serve(args.model, args.host, args.port, max_model_len=args.max_model_len, limits=limits,
                     api_key=args.api_key or os.environ.get("K3_API_KEY") or None, model_name=args.served_model_name,
                     memory_budget=budget, num_pages=args.num_pages, device=device, quantization=args.quantization,
                     max_num_seqs=args.max_num_seqs)  # fmt: skip
    except USER_ERRORS as e:
        return _fail("serve", e)


def cmd_eval(args: argparse.Namespace) -> int:
    """Perplexity (and nats per token) of a model on a text file or a folder of them."""
    from k3.eval import evaluate

    try:
        device = _device(args.device)
        result = evaluate(args.model, args.data, seq_len=args.seq_len, batch_size=args.batch_size, device=device,
                          text_only=args.text_only)  # fmt: skip
    except KeyboardInterrupt:
        print("k3 eval: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except USER_ERRORS as e:
        return _fail("eval", e)
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    skipped = [f"{n} {what}" for n, what in ((result.not_utf8, "not UTF-8 text"), (result.empty, "empty")) if n]
    print(f"perplexity {result.perplexity:.3f} ({result.nats_per_token:.4f} nats/token) over {result.tokens:,} "
          f"tokens of {result.files:,} file{'s' if result.files != 1 else ''}"
          + (f" (skipped: {', '.join(skipped)})" if skipped else "")
          + f"; windows of {result.seq_len} tokens; model {result.model}")  # fmt: skip
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A model folder in the release layout (config.json, sharded safetensors, tokenizer) from a run,
    step or model folder, for vLLM, SGLang, llama.cpp's converter, or k3 itself."""
    from k3.hub import export_model, parse_size

    try:
        out = export_model(args.ckpt, args.out, shard_size=parse_size(args.shard_size), quantize=args.quantize,
                           prefix=args.prefix, force=args.force)  # fmt: skip
    except USER_ERRORS as e:
        return _fail("export", e)
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out}/ ({len(files)} files, {size:,} bytes of weights): {', '.join(files)}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Loss and per-layer MaxVio curves of a run, as PNG files in the run folder; or, for `k3 plot routing`,
    the routing demo's comparison as one PNG at --out."""
    from k3.train.plot import plot_run

    if args.run == "routing":
        from k3.demo.plot import plot_routing

        try:
            print(f"wrote {plot_routing(args.out or 'routing.png')}")
        except RUN_ERRORS as e:
            return _run_error("plot routing", e)
        return 0
    if args.out is not None:
        return _fail("plot", ValueError("--out is for `k3 plot routing`; a run's plots are written into its folder"))
    try:
        for path in plot_run(args.run, log=lambda line: print(line, file=sys.stderr)):
            print(f"wrote {path}")
    except RUN_ERRORS as e:
        return _run_error("plot", e)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Serve the routing demo's page and JSON endpoint until Ctrl-C."""
    from k3.demo.server import serve_routing

    try:
        serve_routing(args.host, args.port)
    except KeyboardInterrupt:
        print("\nk3 demo routing: stopped", file=sys.stderr)
    except OSError as e:
        return _fail("demo routing", ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}"))
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    """Train the small preset on the standard library's source, then sample from it and serve a batch
    of requests through the engine, and plot the run."""
    from k3.serve.llm import LLM
    from k3.train.checkpoint import step_dirs
    from k3.train.plot import plot_run
    from k3.train.trainer import Trainer

    out = Path(args.out)
    print(f"k3 quickstart: training the small K3 preset for {args.steps} steps on the Python standard library's "
          f"source ({args.batch_size} × {args.seq_len} tokens per step), writing to {out}/")  # fmt: skip
    trainer = None
    try:
        trainer = Trainer(_train_args(args, resume=out.is_dir() and bool(step_dirs(out))))
        n = sum(p.numel() for p in trainer.model.parameters())
        print(f"model: {n / 1e6:.1f}M parameters, {trainer.config.num_hidden_layers} layers "
              f"({trainer.config.layer_types.count('kda')} KDA + {trainer.config.layer_types.count('mla')} MLA), "
              f"{trainer.train_data.num_sequences * args.seq_len / 1e6:.1f}M training tokens")  # fmt: skip
        summary = trainer.train()
        llm = LLM(str(out), memory_budget=64 << 20)
    except KeyboardInterrupt:
        return _interrupted("quickstart", args, trainer)
    except RUN_ERRORS as e:
        return _run_error("quickstart", e)
    print(f"\nvalidation loss: {summary['val_loss']:.3f} nats/token after {trainer.step} steps")
    sample = llm.generate(QUICKSTART_PROMPT, _sampling(args.sample_tokens, seed=0))[0]
    rule = "-" * 60
    print(f"\nsample (temperature 0.8, top-p 0.95, seed 0):\n{rule}\n{QUICKSTART_PROMPT}{sample.text}\n{rule}")
    _serve_demo(llm, args.sample_tokens)
    for path in plot_run(out):
        print(f"wrote {path}")
    print(f"\nnext:\n  {next_generate(out)}\n"
          f"  k3 train --preset small --steps 2000 --out runs/longer     # train longer\n"
          f"  k3 params --preset k3                                      # the full 2.8T model, counted")  # fmt: skip
    return 0


def _sampling(max_tokens: int, seed: int):
    from k3.serve.sampling import SamplingParams

    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=seed)


def _serve_demo(llm, max_tokens: int, requests: int = 8) -> None:
    """What serving adds: requests sharing a prefix (a stdlib module's opening), batched by the engine,
    the shared part read from the prefix cache after the first request computed it."""
    import textwrap
    import time

    prefix = Path(textwrap.__file__).read_text(encoding="utf-8")[:1500]
    prompts = [f"{prefix}\n\ndef helper_{i}(text):\n" for i in range(requests)]
    llm.generate(prompts[0], _sampling(1, seed=0))  # the first request: computes the prefix, fills the cache
    start = time.perf_counter()
    outs = llm.generate(prompts[1:], [_sampling(max_tokens, seed=i) for i in range(1, requests)])
    seconds = time.perf_counter() - start
    m = llm.engine.metrics()
    a, b = (llm.tokenizer.encode(p) for p in prompts[:2])
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    print(f"\nserved {requests - 1} more requests sharing their first {shared} prompt tokens in "
          f"{seconds:.1f} s, batched: {sum(len(o.token_ids) for o in outs) / seconds:.0f} output tokens/s; "
          f"{sum(o.num_cached_tokens for o in outs):,} of {sum(o.num_prompt_tokens for o in outs):,} prompt tokens "
          f"came from the prefix cache ({m['state_hit_tokens']:,} resumed from KDA checkpoints)")  # fmt: skip
    print(llm.engine.describe().splitlines()[0])


TRAIN_CHOICES = {
    "preset": sorted(PRESETS),
    "schedule": ["cosine", "wsd"],
    "balancer": ["quantile", "fixed", "none"],
    "expert_optimizer": ["muon", "muon-active", "adamw"],
}


def _add_train_flags(p: argparse.ArgumentParser, **defaults) -> None:
    """One flag per TrainArgs field, its help line from the field's metadata with the default shown."""
    from k3.train.trainer import TrainArgs

    for f in dataclasses.fields(TrainArgs):
        default = defaults.get(f.name, f.default)
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata["help"].replace("%", "%%")
        if f.name == "progress":
            p.add_argument("--no-progress", dest="progress", action="store_false", default=default,
                           help="no progress bar (default: a progress bar on stderr)")  # fmt: skip
        elif f.type is bool:
            p.add_argument(flag, action="store_true", default=default, help=f"{text} (default: off)")
        elif default is dataclasses.MISSING:
            p.add_argument(flag, required=True, help=f"{text} (required)")
        else:
            kind = f.type if f.type in (int, float) else str
            shown = " (default: %(default)s)" if default is not None else ""
            shown = shown or ("" if "default" in text else " (default: none)")
            p.add_argument(flag, type=kind, default=default, help=text + shown,
                           **({"choices": TRAIN_CHOICES[f.name]} if f.name in TRAIN_CHOICES else {}))  # fmt: skip


def _add_serve_parser(sub) -> None:
    from k3.server import limits as L

    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn)")
    srv.add_argument("--model", required=True, help="a model folder, a run folder or a step_* folder")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $K3_API_KEY, else none)")  # fmt: skip
    srv.add_argument("--served-model-name", default=None, help="the model's id in the API (default: the folder name)")
    srv.add_argument("--max-model-len", type=int, default=None,
                     help="context in tokens, prompt + output (default: max_position_embeddings)")  # fmt: skip
    srv.add_argument("--max-tokens-limit", type=int, default=L.MAX_TOKENS_LIMIT,
                     help="largest max_tokens a request may ask (default: %(default)s)")  # fmt: skip
    srv.add_argument("--max-n", type=int, default=L.MAX_N, help="largest n (choices per prompt) (default: %(default)s)")
    srv.add_argument("--max-prompts", type=int, default=L.MAX_PROMPTS,
                     help="prompts in one /v1/completions request (default: %(default)s)")  # fmt: skip
    srv.add_argument("--max-body-bytes", type=int, default=L.MAX_BODY_BYTES,
                     help="largest request body; larger gets 413 (default: %(default)s)")  # fmt: skip
    srv.add_argument("--drain-timeout", type=float, default=L.DRAIN_TIMEOUT_S,
                     help="seconds running requests get to finish after SIGTERM (default: %(default)s)")  # fmt: skip
    srv.add_argument("--max-num-seqs", type=int, default=None, help="requests running at once (default: 64)")
    srv.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    srv.add_argument("--quantization", choices=["mxfp4"], default=None,
                     help="keep the routed experts MXFP4-packed in memory (default: dense)")  # fmt: skip
    size = srv.add_mutually_exclusive_group()
    size.add_argument("--memory-budget", type=float, default=None, help="MiB for the engine's page pool (256)")
    size.add_argument("--num-pages", type=int, default=None, help="the page pool's size in pages instead")
    srv.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3: read, train, serve and measure it.")
    parser.add_argument("--version", action="version", version=f"k3 {k3.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="show versions, devices and the KDA backend each device uses")
    env.set_defaults(func=cmd_env)
    params = sub.add_parser("params", help="count parameters by component; FLOPs, cache and state sizes")
    which = params.add_mutually_exclusive_group()
    which.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration (default: k3)")
    which.add_argument("--config", help="an official config.json, the model folder holding it, or a run or step folder")
    params.add_argument(
        "--context",
        type=_context,
        default=DEFAULT_CONTEXT,
        help=f"tokens each token attends to in MLA, for FLOPs (default {DEFAULT_CONTEXT})",
    )
    params.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    params.set_defaults(func=cmd_params)

    train = sub.add_parser("train", help="train a K3 model (default: the small preset on the stdlib source)")
    _add_train_flags(train)
    train.set_defaults(func=cmd_train)

    quick = sub.add_parser("quickstart", help="train a small K3 for a few minutes, sample from it, plot the run")
    _add_train_flags(quick, out="runs/quickstart", steps=QUICKSTART_STEPS, eval_every=25, ckpt_every=50)
    quick.add_argument("--sample-tokens", type=int, default=120,
                       help="tokens sampled, and generated per served request (default: %(default)s)")  # fmt: skip
    quick.set_defaults(func=cmd_quickstart)

    init = sub.add_parser("init", help="write a randomly initialised checkpoint with a byte-level tokenizer")
    init.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model configuration (default: tiny)")
    init.add_argument("--out", required=True, help="the folder to write (required; must hold no checkpoint)")
    init.add_argument("--seed", type=int, default=0, help="seed of the initialisation (default: 0)")
    init.set_defaults(func=cmd_init)

    gen = sub.add_parser("generate", help="continue a prompt with a checkpoint")
    gen.add_argument("prompt", help='the text to continue; "-" reads it from stdin')
    gen.add_argument("--ckpt", "--model", dest="ckpt", required=True,
                     help="a model folder (config.json + safetensors), a run folder (its newest checkpoint) or a "
                          "step_* folder")  # fmt: skip
    gen.add_argument(
        "--text-only",
        action="store_true",
        help="a multimodal model folder: load the language model, skip vision_tower/mm_projector",
    )
    gen.add_argument(
        "--quantization",
        choices=["mxfp4"],
        default=None,
        help="keep the routed experts MXFP4-packed in memory and compute from them (a packed folder's bytes as "
        "they are, dense weights packed at load); default: dense",
    )
    gen.add_argument("--max-tokens", type=int, default=100, help="tokens to generate at most (default 100)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, 1 is off (default 0.95)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 is off (default 0)")
    gen.add_argument("--stop", action="append", metavar="TEXT",
                     help="end the output before this text, which is not printed (repeatable)")  # fmt: skip
    gen.add_argument("-n", type=int, default=1, help="completions of the prompt, batched (default 1)")
    gen.add_argument("--seed", type=int, default=None,
                     help="repeatable sampling; completion i uses seed + i (default: unseeded)")  # fmt: skip
    gen.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    gen.add_argument("--max-model-len", type=int, default=None,
                     help="the context in tokens, prompt + output (default: max_position_embeddings)")  # fmt: skip
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    gen.add_argument("--verbose", action="store_true", help="print the page pool's layout and capacity to stderr")
    size = gen.add_mutually_exclusive_group()
    size.add_argument("--memory-budget", type=float, default=None, help="MiB for the engine's page pool (256)")
    size.add_argument("--num-pages", type=int, default=None, help="the page pool's size in pages instead")
    gen.set_defaults(func=cmd_generate)

    evaluation = sub.add_parser("eval", help="perplexity of a model on your text (a file or a folder of files)")
    evaluation.add_argument("--model", required=True, help="a model folder, a run folder or a step_* folder")
    evaluation.add_argument("--data", required=True,
                            help="a UTF-8 text file, or a folder: every UTF-8 text file below it")  # fmt: skip
    evaluation.add_argument("--seq-len", type=int, default=None,
                            help="tokens predicted per window (default 512, less for a shorter context)")  # fmt: skip
    evaluation.add_argument("--batch-size", type=int, default=8, help="windows per forward (default 8)")
    evaluation.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    evaluation.add_argument("--text-only", action="store_true",
                            help="a multimodal model folder: load the language model only")  # fmt: skip
    evaluation.add_argument("--json", action="store_true", help="print one JSON object")
    evaluation.set_defaults(func=cmd_eval)

    export = sub.add_parser("export", help="write a model folder in the release layout from a run or checkpoint")
    export.add_argument("--ckpt", required=True, help="a run folder, a step_* folder or a model folder")
    export.add_argument("--out", required=True, help="the model folder to write (must not exist, or be empty)")
    export.add_argument("--shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    export.add_argument(
        "--quantize",
        choices=["mxfp4"],
        default=None,
        help="pack the routed experts as the release does (compressed-tensors MXFP4)",
    )
    export.add_argument(
        "--prefix",
        choices=["model", "language_model"],
        default="model",
        help="model: text-only names; language_model: the multimodal release's (for llama.cpp)",
    )
    export.add_argument("--force", action="store_true", help="replace a non-empty --out (once the new one is written)")
    export.set_defaults(func=cmd_export)

    _add_serve_parser(sub)

    plot = sub.add_parser("plot", help="draw a run's loss and MaxVio curves to PNG, or the routing figure")
    plot.add_argument("run", help="a run folder, or `routing` for the routing demo's figure (a run folder named "
                                  "routing: ./routing)")  # fmt: skip
    plot.add_argument("--out", default=None, help="k3 plot routing: the PNG to write (default: routing.png)")
    plot.set_defaults(func=cmd_plot)

    demo = sub.add_parser("demo", help="serve an interactive figure computed by k3 (routing)")
    figures = demo.add_subparsers(dest="figure", required=True)
    routing = figures.add_parser("routing", help="plain top-k vs Quantile Balancing on k3's own router, in a browser")
    routing.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    routing.add_argument("--port", type=int, default=8001, help="port to listen on (default: %(default)s)")
    routing.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
