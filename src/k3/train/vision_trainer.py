"""Training the vision tower from scratch inside the language model (SPEC §2.10): `k3 train --preset small-vl`.

The examples are k3.data.images' generated images with a question and answer after each. One sequence
per example:

    <|media_begin|> <placeholder> x n <|media_end|> question \\n answer <|endoftext|>

with the loss on every text token after the image (question and answer; the image's own positions and
the padding carry no target). Tower, projector and language model start from random weights and learn
together from that loss alone: no contrastive pre-training. The optimiser, schedule, clipping and
router-bias balancing are the text trainer's (k3.train.optim, k3.train.balance); the checkpoints are the
same format (k3.formats.checkpoint), so `k3 generate --model RUN --image ...` and `LLM(model=RUN)` load them.

`use_images=False` trains the text-only baseline: the same sequences without the image span, so it
learns what the questions alone tell about the answers (docs/vision.md compares the two).

A run folder is started fresh: --resume, --init-from and --data do not apply to this trainer yet, and are
refused by name.
"""

import json
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from k3.config import K3Config
from k3.data.image_input import image_to_tensor
from k3.data.images import all_texts, example
from k3.data.media import MEDIA_TOKENS, image_span, media_token_ids
from k3.formats.checkpoint import save_checkpoint, step_dirs
from k3.formats.files import append_line
from k3.formats.tokenizer import K3Tokenizer, train_tokenizer
from k3.model import K3Model
from k3.model.vision import image_tokens
from k3.train.balance import QuantileBalancer
from k3.train.optim import build_optimizer, lr_at, set_lr_factor

TOKENIZER_VOCAB = 512  # the generated texts' words need far fewer; BPE stops when it runs out of pairs


def vision_tokenizer() -> K3Tokenizer:
    """A byte-level BPE learned from every text the generator can produce, with the media tokens added."""
    tok = train_tokenizer(all_texts() * 4, TOKENIZER_VOCAB)
    tok.tok.add_special_tokens(MEDIA_TOKENS)
    return tok


def vision_config_for(preset: str, tokenizer: K3Tokenizer) -> K3Config:
    """The preset with the tokenizer's vocabulary and placeholder id."""
    config = K3Config.from_preset(preset, vocab_size=tokenizer.vocab_size)
    if config.vision_config is None:
        raise ValueError(f"--preset {preset} has no vision_config: image-text training needs a vision preset")
    placeholder = media_token_ids(tokenizer)[1]
    return replace(config, vision_config=replace(config.vision_config, media_placeholder_token_id=placeholder))


@dataclass
class Encoded:
    ids: list[int]
    labels: list[int]  # -100 where there is no target
    image: torch.Tensor | None  # (3, H, W), None for the text-only baseline
    answer: list[int]  # the answer's ids and the end-of-text id, for accuracy
    prompt_len: int  # ids[:prompt_len] is the prompt a model answers from
    task: str


def encode(ex, tokenizer: K3Tokenizer, config: K3Config, use_images: bool = True) -> Encoded:
    """One generated example as token ids, labels and its image tensor."""
    image = image_to_tensor(ex.image, config.vision_config) if use_images else None
    span = image_span(tokenizer, image_tokens(tuple(image.shape), config.vision_config)) if use_images else []
    question = tokenizer.encode(ex.question + "\n")
    answer = [*tokenizer.encode(ex.answer), tokenizer.eos_id]
    ids = [*span, *question, *answer]
    labels = [-100] * len(span) + [*question, *answer]
    return Encoded(ids, labels, image, answer, len(span) + len(question), ex.task)


def collate(items: list[Encoded], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(ids (B, T), labels (B, T), images) with right padding (pad id, no target)."""
    T = max(len(e.ids) for e in items)
    ids = torch.full((len(items), T), pad_id)
    labels = torch.full((len(items), T), -100)
    for i, e in enumerate(items):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
    return ids, labels, [e.image for e in items if e.image is not None]


def batch_loss(model: K3Model, items: list[Encoded], pad_id: int):
    ids, labels, images = collate(items, pad_id)
    embeds = model.encode_images(images) if images else None
    return model(ids, labels=labels, image_embeds=embeds)


# The TrainArgs this trainer reads; any other flag set away from its default is refused, not silently ignored.
USED_FLAGS = {"out", "preset", "steps", "batch_size", "lr", "min_lr_ratio", "warmup", "schedule", "weight_decay",
              "clip", "eval_every", "eval_batches", "keep_last", "seed", "balancer", "qb_bins", "progress"}  # fmt: skip


def _check(args) -> None:
    for f in fields(args):
        if f.name not in USED_FLAGS and getattr(args, f.name) != f.default:
            raise ValueError(f"--{f.name.replace('_', '-')}: the image-text trainer (--preset {args.preset}) starts a "
                             f"fresh run on generated images; it does not take this flag yet")  # fmt: skip
    if args.balancer == "fixed":
        raise ValueError(f"--balancer fixed: the image-text trainer (--preset {args.preset}) balances with quantile "
                         f"or none")  # fmt: skip
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or step_dirs(out)):
        raise ValueError(f"--out {out} already holds a run (or is a file): choose a new --out")


def train_vision(args, log=print, use_images: bool = True) -> dict[str, Any]:
    """Train args.steps steps of args.batch_size generated examples; returns the last metrics, with
    `seconds` (wall time of the loop) and `run` (the folder). `args` is a k3.train.trainer.TrainArgs."""
    _check(args)
    run = Path(args.out)
    run.mkdir(parents=True, exist_ok=True)
    tokenizer = vision_tokenizer()
    tokenizer.save(run / "tokenizer.json")
    config = vision_config_for(args.preset, tokenizer)
    torch.manual_seed(args.seed)
    model = K3Model(config)
    optimizer = build_optimizer(model, lr=args.lr, weight_decay=args.weight_decay)
    balancer = QuantileBalancer(model, num_bins=args.qb_bins) if args.balancer == "quantile" else None
    pad = tokenizer.tok.token_to_id("<|pad|>")
    val = [encode(example("eval", i, args.seed), tokenizer, config, use_images)
           for i in range(args.eval_batches * args.batch_size)]  # fmt: skip
    n = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for name, p in model.named_parameters() if name.startswith(("vision_tower", "mm_projector")))
    log(f"model: {n / 1e6:.2f}M parameters ({tower / 1e6:.2f}M vision tower + projector), images: {use_images}")
    record: dict[str, Any] = {}
    start = time.perf_counter()
    bar = tqdm(total=args.steps, disable=not args.progress, unit="step", dynamic_ncols=True)
    model.train()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        set_lr_factor(optimizer, lr_at(step - 1, args.steps, min(args.warmup, args.steps), args.schedule,
                                       args.min_lr_ratio))  # fmt: skip
        first = (step - 1) * args.batch_size
        items = [encode(example("train", first + i, args.seed), tokenizer, config, use_images)
                 for i in range(args.batch_size)]  # fmt: skip
        out = batch_loss(model, items, pad)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).item()
        if balancer is not None:
            balancer.observe(out.routing)
            balancer.update()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record = {"step": step, "loss": out.loss.item(), "grad_norm": grad_norm, "step_s": time.perf_counter() - t0}
        if step % args.eval_every == 0 or step == args.steps:
            record["val_loss"] = evaluate_loss(model, val, pad, args.batch_size)
        append_line(run / "metrics.jsonl", json.dumps(record))
        bar.update(1)
        bar.set_postfix(
            loss=f"{record['loss']:.3f}", **({"val": f"{record['val_loss']:.3f}"} if "val_loss" in record else {})
        )
    bar.close()
    seconds = time.perf_counter() - start
    state = {"position": args.steps * args.batch_size, "args": asdict(args), "tokenizer": "tokenizer.json",
             "images": use_images}  # fmt: skip
    save_checkpoint(run, args.steps, model, optimizer, config, state, keep_last=max(1, args.keep_last))
    return {**record, "seconds": seconds, "run": str(run), "model": model, "tokenizer": tokenizer}


@torch.no_grad()
def evaluate_loss(model: K3Model, items: list[Encoded], pad_id: int, batch_size: int) -> float:
    was_training = model.training
    model.eval()
    losses = [
        batch_loss(model, items[i : i + batch_size], pad_id).loss.item() for i in range(0, len(items), batch_size)
    ]
    model.train(was_training)
    return sum(losses) / len(losses)


@torch.no_grad()
def answer_accuracy(
    model: K3Model, tokenizer: K3Tokenizer, split: str, n: int, use_images: bool = True, seed: int = 0
) -> dict[str, tuple[int, int]]:
    """Greedy answers to n generated examples of `split` (k3.data.images): task -> (exact matches, asked)."""
    from k3.model.generate import generate

    model.eval()
    scores: dict[str, list[int]] = {}
    for i in range(n):
        ex = example(split, i, seed)
        e = encode(ex, tokenizer, model.config, use_images)
        prompt = torch.tensor([e.ids[: e.prompt_len]])
        embeds = model.encode_images([e.image]) if use_images else None
        out = generate(model, prompt, len(e.answer) + 4, temperature=0, eos_token_id=tokenizer.eos_id,
                       image_embeds=embeds)[0, e.prompt_len :].tolist()  # fmt: skip
        text = tokenizer.decode(out[: out.index(tokenizer.eos_id)] if tokenizer.eos_id in out else out)
        hit = scores.setdefault(ex.task, [0, 0])
        hit[0] += int(text.strip() == ex.answer)
        hit[1] += 1
    return {task: (c, t) for task, (c, t) in sorted(scores.items())}
