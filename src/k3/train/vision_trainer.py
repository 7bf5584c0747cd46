"""Training the vision tower from scratch inside the language model (SPEC §2.10): `k3 train --preset small-vl`.

The examples are k3.data.images' generated images with a question and answer after each. One sequence
per example:

    <|media_begin|> <placeholder> x n <|media_end|> question \\n answer <|endoftext|>

with the loss on every text token after the image (question and answer; the image's own positions and
the padding carry no target). Tower, projector and language model start from random weights and learn
together from that loss alone: no contrastive pre-training. The optimiser, schedule, clipping and
router-bias balancing are the text trainer's (k3.train.optim, k3.train.balance); the run folder is the same
(k3.formats.run_folder: run.json, tokenizer.json, metrics.jsonl, step_*/ checkpoints), so `k3 generate
--model RUN --image ...` and `LLM(model=RUN)` load it, and --resume continues it exactly as `k3 train`
does: step n's examples are the n-th of the generator, whatever ran before.

`use_images=False` trains the text-only baseline: the same sequences without the image span, so it
learns what the questions alone tell about the answers (docs/vision.md compares the two).

The flags of the text trainer that do not apply to generated images (--data, --init-from, --grad-accum,
...) are refused by name.
"""

import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from k3.config import K3Config
from k3.data.image_input import image_to_tensor
from k3.data.images import all_texts, example
from k3.data.media import MEDIA_TOKENS, image_span, media_token_ids
from k3.formats.run_args import RunArgs, flag
from k3.formats.run_folder import TOKENIZER, RunFolder
from k3.formats.run_record import RunRecord
from k3.formats.tokenizer import K3Tokenizer, train_tokenizer
from k3.model import K3Model
from k3.model.vision import image_tokens
from k3.train.balance import QuantileBalancer
from k3.train.optim import build_optimizer, hyperparameters_kept, lr_at, set_lr_factor

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


# The TrainArgs this trainer reads (RunArgs' own and these); any other flag set away from its default is refused,
# not silently ignored.
OPTIMISER_FLAGS = ("lr", "min_lr_ratio", "warmup", "schedule", "weight_decay", "clip", "balancer", "qb_bins")
DATA_FLAGS = ("preset", "batch_size", "eval_every", "eval_batches")
USED_FLAGS = {*(f.name for f in fields(RunArgs)), *DATA_FLAGS, *OPTIMISER_FLAGS}


def _check(args) -> None:
    for f in fields(args):
        if f.name not in USED_FLAGS and getattr(args, f.name) != f.default:
            raise ValueError(
                f"{flag(f.name)}: the image-text trainer (--preset {args.preset}) trains on generated "
                f"images; it does not take this flag yet"
            )
    if args.balancer == "fixed":
        raise ValueError(
            f"--balancer fixed: the image-text trainer (--preset {args.preset}) balances with quantile or none"
        )


class VisionTrainer:
    """Tower, projector and language model trained together on generated examples; `args` is a
    k3.train.trainer.TrainArgs. A RunFolder user, as the text trainer: --resume continues from the newest
    checkpoint and logs what an unbroken run logs."""

    def __init__(self, args, log=print, use_images: bool = True):
        _check(args)
        self.args, self.log, self.use_images = args, log, use_images
        self.folder = folder = RunFolder(args, log)
        ckpt = folder.resume_from()
        # `images` is no flag, but a baseline resumed with images (or the reverse) would be another run
        now = RunRecord({**args.recorded(), "images": use_images}, None, None, folder.tokenizer_sha256(), [])
        folder.reconcile(now, ckpt)  # reads only: a mismatch leaves no files
        if ckpt is None:
            self.tokenizer = vision_tokenizer()
            self.config = vision_config_for(args.preset, self.tokenizer)
        else:
            self.tokenizer = K3Tokenizer.load(folder.path / TOKENIZER)
            self.config = ckpt.config
        folder.open()
        if ckpt is None:
            self.tokenizer.save(folder.path / TOKENIZER)
        folder.record_tokenizer()
        torch.manual_seed(args.seed)
        self.model = K3Model(self.config)
        self.optimizer = build_optimizer(self.model, lr=args.lr, weight_decay=args.weight_decay)
        self.balancer = QuantileBalancer(self.model, num_bins=args.qb_bins) if args.balancer == "quantile" else None
        self.pad = self.tokenizer.tok.token_to_id("<|pad|>")
        examples = [example("eval", i, args.seed) for i in range(args.eval_batches * args.batch_size)]
        self.val = [encode(ex, self.tokenizer, self.config, use_images) for ex in examples]
        self.step = 0
        if ckpt is not None:
            ckpt.load_model(self.model)
            with hyperparameters_kept(self.optimizer):
                ckpt.load_optimizer(self.optimizer, self.model)
            torch.set_rng_state(ckpt.tensors("extra.safetensors")["rng.torch"])
            if self.balancer is not None:
                self.balancer.load_state_dict(ckpt.state.get("balancer", {}))
            self.step = ckpt.step
            log(f"resumed from {ckpt.path} at step {self.step}")

    def _step(self) -> dict[str, Any]:
        a, step = self.args, self.step + 1
        t0 = time.perf_counter()
        set_lr_factor(self.optimizer, lr_at(step - 1, a.steps, min(a.warmup, a.steps), a.schedule, a.min_lr_ratio))
        first = (step - 1) * a.batch_size
        examples = [example("train", first + i, a.seed) for i in range(a.batch_size)]
        items = [encode(ex, self.tokenizer, self.config, self.use_images) for ex in examples]
        out = batch_loss(self.model, items, self.pad)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.clip).item()
        if self.balancer is not None:
            self.balancer.observe(out.routing)
            self.balancer.update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        record = {"step": step, "loss": out.loss.item(), "grad_norm": grad_norm, "step_s": time.perf_counter() - t0}
        if step % a.eval_every == 0 or step == a.steps:
            record["val_loss"] = evaluate_loss(self.model, self.val, self.pad, a.batch_size)
        return record

    def save(self) -> Path:
        state = {
            "position": self.step * self.args.batch_size,
            "args": asdict(self.args),
            "tokenizer": TOKENIZER,
            "images": self.use_images,
            "balancer": self.balancer.state_dict() if self.balancer is not None else {},
        }
        return self.folder.save(self.step, self.model, self.optimizer, self.config, state)

    def train(self) -> dict[str, Any]:
        """Train up to --steps; returns the newest value of each metric, with `seconds` (wall time of the loop),
        `run` (the folder), the model and the tokenizer."""
        named = dict(self.model.named_parameters())
        n = sum(p.numel() for p in named.values())
        tower = sum(p.numel() for name, p in named.items() if name.startswith(("vision_tower", "mm_projector")))
        self.log(
            f"model: {n / 1e6:.2f}M parameters ({tower / 1e6:.2f}M vision tower + projector), images: {self.use_images}"
        )

        def shown(record: dict[str, Any]) -> dict[str, str]:
            val = {"val": f"{record['val_loss']:.3f}"} if "val_loss" in record else {}
            return {"loss": f"{record['loss']:.3f}", **val}

        start = time.perf_counter()
        self.model.train()
        self.folder.train(self.step, self._step, self.save, shown)
        seconds = time.perf_counter() - start
        summary = self.folder.summary(self.step)
        return {
            **summary,
            "seconds": seconds,
            "run": str(self.folder.path),
            "model": self.model,
            "tokenizer": self.tokenizer,
        }


def train_vision(args, log=print, use_images: bool = True) -> dict[str, Any]:
    """VisionTrainer(args, log, use_images).train()."""
    return VisionTrainer(args, log, use_images).train()


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
        out = generate(
            model, prompt, len(e.answer) + 4, temperature=0, eos_token_id=tokenizer.eos_id, image_embeds=embeds
        )[0, e.prompt_len :].tolist()
        text = tokenizer.decode(out[: out.index(tokenizer.eos_id)] if tokenizer.eos_id in out else out)
        hit = scores.setdefault(ex.task, [0, 0])
        hit[0] += int(text.strip() == ex.answer)
        hit[1] += 1
    return {task: (c, t) for task, (c, t) in sorted(scores.items())}
