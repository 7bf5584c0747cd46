"""The `k3` argument parser and `main`: every subcommand's flags, dispatching to its module."""

import argparse

import k3
from k3.cli.common import _context
from k3.cli.distill import add_distill_parser
from k3.cli.generation import cmd_eval, cmd_generate
from k3.cli.info import cmd_env, cmd_params
from k3.cli.spec import add_train_draft_parser
from k3.cli.tools import _add_serve_parser, cmd_demo, cmd_export, cmd_plot
from k3.cli.training import QUICKSTART_DEFAULTS, _add_train_flags, cmd_init, cmd_quickstart, cmd_train
from k3.config import PRESETS
from k3.eval_lengths import EVAL_TASKS
from k3.hub.export import QUANTIZE_FORMATS
from k3.hub.gguf import OUTTYPES as GGUF_OUTTYPES
from k3.hub.load import QUANTIZATIONS
from k3.model.params import DEFAULT_CONTEXT
from k3.ops.compute_dtype import CHOICES as DTYPE_CHOICES


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
    params.add_argument("--ep", type=int, help="also the training memory per rank at this expert parallelism")
    params.add_argument("--dp", type=int, help="with --ep: FSDP ranks (a multiple of --ep; default: --ep)")
    params.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=8192,
        help="with --ep: tokens per rank per micro-batch (default: %(default)s)",
    )
    params.set_defaults(func=cmd_params)

    train = sub.add_parser("train", help="train a K3 model (default: the small preset on the stdlib source)")
    _add_train_flags(train)
    train.add_argument(
        "--nproc", type=int, default=1, help="processes on this machine (runs torchrun; default: %(default)s)"
    )
    train.set_defaults(func=cmd_train)

    quick = sub.add_parser("quickstart", help="train a small K3 for a few minutes, sample from it, plot the run")
    _add_train_flags(quick, **QUICKSTART_DEFAULTS)
    quick.add_argument(
        "--sample-tokens",
        type=int,
        default=120,
        help="tokens sampled, and generated per served request (default: %(default)s)",
    )
    quick.set_defaults(func=cmd_quickstart)

    init = sub.add_parser("init", help="write a randomly initialised checkpoint with a byte-level tokenizer")
    init.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model configuration (default: tiny)")
    init.add_argument("--out", required=True, help="the folder to write (required; must hold no checkpoint)")
    init.add_argument("--seed", type=int, default=0, help="seed of the initialisation (default: 0)")
    init.set_defaults(func=cmd_init)

    gen = sub.add_parser("generate", help="continue a prompt with a checkpoint")
    gen.add_argument("prompt", help='the text to continue; "-" reads it from stdin')
    gen.add_argument(
        "--ckpt",
        "--model",
        dest="ckpt",
        required=True,
        help="a model folder (config.json + safetensors), a run folder (its newest checkpoint) or a step_* folder",
    )
    gen.add_argument(
        "--text-only",
        action="store_true",
        help="a multimodal model folder: load the language model, skip vision_tower/mm_projector",
    )
    gen.add_argument(
        "--quantization",
        choices=[q for q in QUANTIZATIONS if q is not None],
        default=None,
        help="keep the routed experts MXFP4-packed in memory and compute from them (a packed folder's bytes as "
        "they are, dense weights packed at load); default: dense",
    )
    gen.add_argument("--max-tokens", type=int, default=100, help="tokens to generate at most (default 100)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, 1 is off (default 0.95)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 is off (default 0)")
    gen.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end the output before this text, which is not printed (repeatable)",
    )
    gen.add_argument("-n", type=int, default=1, help="completions of the prompt, batched (default 1)")
    gen.add_argument(
        "--seed", type=int, default=None, help="repeatable sampling; completion i uses seed + i (default: unseeded)"
    )
    gen.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    gen.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the context in tokens, prompt + output (default: max_position_embeddings)",
    )
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    gen.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an image before the prompt, for a vision model (repeatable; docs/vision.md)",
    )
    gen.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="float32",
        help="the weights' and activations' dtype; auto: bfloat16 where this machine's bf16 matmuls measure "
        "≥ 1.5× fp32's, KDA states stay fp32 (default: %(default)s)",
    )
    gen.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run each engine step as one compiled graph: faster steps after a compile of ~10 s (~1 min the first "
        "time on a machine), so for long outputs; k3 serve compiles by default (default: off)",
    )
    gen.add_argument("--verbose", action="store_true", help="print the page pool's layout and capacity to stderr")
    size = gen.add_mutually_exclusive_group()
    size.add_argument("--memory-budget", type=float, default=None, help="MiB for the engine's page pool (256)")
    size.add_argument("--num-pages", type=int, default=None, help="the page pool's size in pages instead")
    gen.set_defaults(func=cmd_generate)

    evaluation = sub.add_parser("eval", help="perplexity of a model on your text, or accuracy/loss by context length")
    evaluation.add_argument("--model", required=True, help="a model folder, a run folder or a step_* folder")
    evaluation.add_argument(
        "--data",
        default=None,
        help="a UTF-8 text file, or a folder: every UTF-8 text file below it (needed for "
        "perplexity; for --task lm the run's validation tokens by default)",
    )
    evaluation.add_argument(
        "--task",
        default=None,
        choices=EVAL_TASKS,
        help="score by context length instead: a synthetic long-range task (held-out "
        "examples) or lm (nats/token of --data at each length)",
    )
    evaluation.add_argument(
        "--lengths",
        default="512,2048,8192",
        help="with --task: comma-separated context lengths (default 512,2048,8192)",
    )
    evaluation.add_argument(
        "--examples", type=int, default=20, help="with --task: examples (lm: windows) per length (default 20)"
    )
    evaluation.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="with --task mqar: key-value bindings per example (default: as many as fit each length)",
    )
    evaluation.add_argument(
        "--chunk-tokens",
        type=int,
        default=1024,
        help="with --task: tokens per forward through the cache (default 1024)",
    )
    evaluation.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens predicted per window (default 512, less for a shorter context)",
    )
    evaluation.add_argument("--batch-size", type=int, default=8, help="windows per forward (default 8)")
    evaluation.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    evaluation.add_argument(
        "--text-only", action="store_true", help="a multimodal model folder: load the language model only"
    )
    evaluation.add_argument("--json", action="store_true", help="print one JSON object")
    evaluation.set_defaults(func=cmd_eval)

    export = sub.add_parser(
        "export", help="write a model folder in the release layout, or a GGUF file for llama.cpp, from a run"
    )
    export.add_argument("--ckpt", required=True, help="a run folder, a step_* folder or a model folder")
    export.add_argument(
        "--out", required=True, help="the model folder to write (must not exist, or be empty), or the .gguf file"
    )
    export.add_argument(
        "--format",
        choices=["folder", "gguf"],
        default="folder",
        help="folder: the release layout (safetensors); gguf: one file for llama.cpp's kimi-k3 (needs k3[gguf])",
    )
    export.add_argument(
        "--outtype",
        choices=list(GGUF_OUTTYPES),
        default=None,
        help="--format gguf: f32 (default; computes as k3), bf16, or mxfp4 (bf16 with MXFP4 routed experts)",
    )
    export.add_argument("--shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    export.add_argument(
        "--quantize",
        choices=[q for q in QUANTIZE_FORMATS if q is not None],
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
    add_distill_parser(sub)
    add_train_draft_parser(sub)

    plot = sub.add_parser("plot", help="draw a run's loss and MaxVio curves to PNG, or the routing figure")
    plot.add_argument(
        "run", help="a run folder, or `routing` for the routing demo's figure (a run folder named routing: ./routing)"
    )
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
