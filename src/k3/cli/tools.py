"""`k3 serve`, `k3 export`, `k3 plot` and `k3 demo`."""

import argparse
import os
import sys

from k3.cli.common import RUN_ERRORS, USER_ERRORS, _device, _fail, _run_error
from k3.hub.load import QUANTIZATIONS
from k3.ops.compute_dtype import CHOICES as DTYPE_CHOICES


def cmd_serve(args: argparse.Namespace) -> int:
    """An OpenAI-compatible HTTP server over the engine until SIGTERM or Ctrl-C (docs/serving.md)."""
    try:
        from k3.server.main import serve
    except ImportError as e:
        print(f"k3 serve: {e.name or e} is not installed; pip install 'k3[serve]'", file=sys.stderr)
        return 2

    limits = {
        "max_body_bytes": args.max_body_bytes,
        "max_tokens": args.max_tokens_limit,
        "max_n": args.max_n,
        "max_prompts": args.max_prompts,
        "drain_timeout_s": args.drain_timeout,
        "header_timeout_s": args.header_timeout,
        "body_timeout_s": args.body_timeout,
        "write_timeout_s": args.write_timeout,
        "keep_alive_timeout_s": args.keep_alive_timeout,
        "max_connections": args.max_connections,
        "max_stream_backlog": args.max_stream_backlog,
    }
    try:
        device = _device(args.device)
        budget = None if args.memory_budget is None else int(args.memory_budget * (1 << 20))
        return serve(
            args.model,
            args.host,
            args.port,
            max_model_len=args.max_model_len,
            limits=limits,
            api_key=args.api_key or os.environ.get("K3_API_KEY") or None,
            model_name=args.served_model_name,
            memory_budget=budget,
            num_pages=args.num_pages,
            device=device,
            quantization=args.quantization,
            max_num_seqs=args.max_num_seqs,
            speculative_model=args.speculative_model,
            compile=args.compile,
            dtype=args.dtype,
        )
    except USER_ERRORS as e:
        return _fail("serve", e)


def cmd_export(args: argparse.Namespace) -> int:
    """A model folder in the release layout (config.json, sharded safetensors, tokenizer) from a run,
    step or model folder, for vLLM, SGLang or k3 itself; or, with --format gguf, one GGUF file for llama.cpp."""
    from k3.hub import export_model, parse_size

    if args.format == "gguf":
        return _export_gguf(args)
    if args.outtype is not None:
        print("k3 export: --outtype is for --format gguf (a folder keeps the model's dtype)", file=sys.stderr)
        return 2
    try:
        out = export_model(
            args.ckpt,
            args.out,
            shard_size=parse_size(args.shard_size),
            quantize=args.quantize,
            prefix=args.prefix,
            force=args.force,
        )
    except USER_ERRORS as e:
        return _fail("export", e)
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out}/ ({len(files)} files, {size:,} bytes of weights): {', '.join(files)}")
    return 0


def _export_gguf(args: argparse.Namespace) -> int:
    from k3.hub.gguf import export_gguf

    folder_only = {"--quantize": args.quantize is not None, "--prefix": args.prefix != "model"}
    folder_only["--shard-size"] = args.shard_size != "5GB"
    given = [flag for flag, set_ in folder_only.items() if set_]
    if given:
        print(
            f"k3 export: {', '.join(given)} shape a model folder; with --format gguf choose the storage "
            "with --outtype (mxfp4 packs the routed experts)",
            file=sys.stderr,
        )
        return 2
    try:
        out = export_gguf(args.ckpt, args.out, outtype=args.outtype or "f32", force=args.force)
    except ImportError as e:
        print(f"k3 export: {e}", file=sys.stderr)
        return 2
    except USER_ERRORS as e:
        return _fail("export", e)
    print(f"wrote {out} ({out.stat().st_size:,} bytes; llama.cpp architecture kimi-k3, {args.outtype or 'f32'})")
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


def _add_serve_parser(sub) -> None:
    from k3.server import limits as L

    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn)")
    srv.add_argument("--model", required=True, help="a model folder, a run folder or a step_* folder")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    srv.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: $K3_API_KEY, else none)"
    )
    srv.add_argument("--served-model-name", default=None, help="the model's id in the API (default: the folder name)")
    srv.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context in tokens, prompt + output (default: max_position_embeddings)",
    )
    srv.add_argument(
        "--max-tokens-limit",
        type=int,
        default=L.MAX_TOKENS_LIMIT,
        help="largest max_tokens a request may ask (default: %(default)s)",
    )
    srv.add_argument("--max-n", type=int, default=L.MAX_N, help="largest n (choices per prompt) (default: %(default)s)")
    srv.add_argument(
        "--max-prompts",
        type=int,
        default=L.MAX_PROMPTS,
        help="prompts in one /v1/completions request (default: %(default)s)",
    )
    srv.add_argument(
        "--max-body-bytes",
        type=int,
        default=L.MAX_BODY_BYTES,
        help="largest request body; larger gets 413 (default: %(default)s)",
    )
    srv.add_argument(
        "--drain-timeout",
        type=float,
        default=L.DRAIN_TIMEOUT_S,
        help="seconds running requests get to finish after SIGTERM (default: %(default)s)",
    )
    timing = [
        ("--header-timeout", L.HEADER_TIMEOUT_S, "seconds a connection has to send a request's headers"),
        ("--body-timeout", L.BODY_TIMEOUT_S, "seconds a request has to send its body (408 after)"),
        ("--write-timeout", L.WRITE_TIMEOUT_S, "seconds a response write may wait on the client before it is cut"),
        ("--keep-alive-timeout", L.KEEP_ALIVE_TIMEOUT_S, "seconds an idle kept-alive connection stays open"),
    ]
    for flag, default, text in timing:
        srv.add_argument(flag, type=float, default=default, help=f"{text} (default: %(default)s)")
    counts = [
        ("--max-connections", L.MAX_CONNECTIONS, "open connections at once; more get 503"),
        ("--max-stream-backlog", L.MAX_STREAM_BACKLOG, "outputs a stream may leave unread before it is aborted"),
    ]
    for flag, default, text in counts:
        srv.add_argument(flag, type=int, default=default, help=f"{text} (default: %(default)s)")
    srv.add_argument("--max-num-seqs", type=int, default=None, help="requests running at once (default: 64)")
    srv.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    srv.add_argument(
        "--quantization",
        choices=[q for q in QUANTIZATIONS if q is not None],
        default=None,
        help="keep the routed experts MXFP4-packed in memory (default: dense)",
    )
    size = srv.add_mutually_exclusive_group()
    size.add_argument("--memory-budget", type=float, default=None, help="MiB for the engine's page pool (256)")
    size.add_argument("--num-pages", type=int, default=None, help="the page pool's size in pages instead")
    srv.add_argument(
        "--speculative-model", default=None, help="a draft folder from `k3 train-draft`: speculative decoding"
    )
    srv.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="float32",
        help="the weights' and activations' dtype; auto: bfloat16 where this machine's bf16 matmuls measure "
        "≥ 1.5× fp32's (faster batches; at batch 1 it can be slower), KDA states stay fp32 (default: %(default)s)",
    )
    srv.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each engine step as one compiled graph (default: where the model and machine allow it, "
        "$K3_COMPILE=auto); --no-compile runs the eager reference",
    )
    srv.set_defaults(func=cmd_serve)
