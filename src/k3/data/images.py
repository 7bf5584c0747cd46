"""Procedural image-text examples (Pillow), for training the vision tower from scratch inside the language
model and for measuring that it learned to see (SPEC §2.10, docs/vision.md).

An image is a white canvas of h x w pixels (multiples of 28: one LM token per 28 x 28 after the 2x2
merge) holding either 1-4 coloured shapes, each centred in its own 28 x 28 cell, or one large glyph (a
digit or a capital letter). The text after it is a question and its answer:

    count        "How many shapes are there?"      -> "3"
    count_kind   "How many circles are there?"     -> "2"  (0 when there is none)
    color        "What color is the square?"       -> "blue"  (asked only of a shape that occurs once)
    caption      "Describe the image."             -> "1 red circle, 2 blue squares"  (colour order, then
                                                      shape order)
    glyph        "What is written?"                -> "7"

Everything is a function of (split, index, seed). "train" draws sizes from TRAIN_SIZES and never puts a
HELD_OUT_PAIRS colour on that shape; the evaluation splits draw from streams disjoint from training:
"eval" as training does, "eval-sizes" at HELD_OUT_SIZES (larger and more elongated than any training
image), "eval-pairs" with at least one held-out colour-shape pair in every shape image.
"""

import hashlib
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

COLORS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
GLYPHS = "0123456789ACEHKLMPRTXZ"
CELL = 28  # pixels per LM token side (patch 14, 2x2 merge)
TRAIN_SIZES = tuple((h, w) for h in (56, 84, 112) for w in (56, 84, 112))
HELD_OUT_SIZES = ((140, 140), (56, 168), (168, 84), (140, 56), (168, 168))
HELD_OUT_PAIRS = frozenset({("red", "triangle"), ("blue", "circle"), ("yellow", "square")})
SPLITS = ("train", "eval", "eval-sizes", "eval-pairs")
TASKS = ("count", "count_kind", "color", "caption", "glyph")
QUESTIONS = {
    "count": "How many shapes are there?",
    "count_kind": "How many {shape}s are there?",
    "color": "What color is the {shape}?",
    "caption": "Describe the image.",
    "glyph": "What is written?",
}


@dataclass(frozen=True)
class Shape:
    color: str
    shape: str
    row: int  # the 28 x 28 cell it is centred in
    col: int


@dataclass(frozen=True)
class ImageExample:
    image: Image.Image  # RGB, (w, h) in Pillow's order
    task: str
    question: str
    answer: str
    shapes: tuple[Shape, ...] = ()
    glyph: str | None = None


def _rng(split: str, index: int, seed: int) -> random.Random:
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: choose one of {', '.join(SPLITS)}")
    digest = hashlib.sha256(f"k3-images:{split}:{seed}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def caption(shapes: tuple[Shape, ...]) -> str:
    """'1 red circle, 2 blue squares': counts per (colour, shape), colours then shapes in table order."""
    parts = []
    for color in COLORS:
        for shape in SHAPES:
            n = sum(1 for s in shapes if s.color == color and s.shape == shape)
            if n:
                parts.append(f"{n} {color} {shape}{'s' if n > 1 else ''}")
    return ", ".join(parts)


def _draw_shape(draw: ImageDraw.ImageDraw, s: Shape, rng: random.Random) -> None:
    r = rng.randint(8, 12)
    cx = s.col * CELL + CELL // 2 + rng.randint(-2, 2)
    cy = s.row * CELL + CELL // 2 + rng.randint(-2, 2)
    fill = COLORS[s.color]
    if s.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif s.shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)


def _pairs(split: str) -> list[tuple[str, str]]:
    every = [(c, s) for c in COLORS for s in SHAPES]
    return [p for p in every if p not in HELD_OUT_PAIRS] if split in ("train", "eval", "eval-sizes") else every


def _shapes(rng: random.Random, split: str, h: int, w: int) -> tuple[Shape, ...]:
    cells = [(r, c) for r in range(h // CELL) for c in range(w // CELL)]
    n = rng.randint(1, min(4, len(cells)))
    chosen = rng.sample(cells, n)
    pairs = _pairs(split)
    picked = [rng.choice(pairs) for _ in range(n)]
    if split == "eval-pairs" and not any(p in HELD_OUT_PAIRS for p in picked):
        picked[rng.randrange(n)] = rng.choice(sorted(HELD_OUT_PAIRS))
    return tuple(Shape(c, s, r, col) for (c, s), (r, col) in zip(picked, chosen, strict=True))


def example(split: str, index: int, seed: int = 0) -> ImageExample:
    """The index-th example of a split: an image and one question with its answer."""
    rng = _rng(split, index, seed)
    h, w = rng.choice(HELD_OUT_SIZES if split == "eval-sizes" else TRAIN_SIZES)
    image = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    task = rng.choice(TASKS)
    if task == "glyph":
        glyph = rng.choice(GLYPHS)
        size = rng.randint(30, min(h, w) - 6) if min(h, w) > 36 else 30
        font = ImageFont.load_default(size=size)
        left, top, right, bottom = draw.textbbox((0, 0), glyph, font=font)
        x = rng.randint(0, max(0, w - (right - left))) - left
        y = rng.randint(0, max(0, h - (bottom - top))) - top
        draw.text((x, y), glyph, fill=(0, 0, 0), font=font)
        return ImageExample(image, task, QUESTIONS[task], glyph, glyph=glyph)
    shapes = _shapes(rng, split, h, w)
    for s in shapes:
        _draw_shape(draw, s, rng)
    if task == "color":
        single = [k for k in SHAPES if sum(s.shape == k for s in shapes) == 1]
        if not single:  # no shape occurs exactly once: ask for the count of one instead
            task = "count_kind"
        else:
            kind = rng.choice(single)
            color = next(s.color for s in shapes if s.shape == kind)
            return ImageExample(image, task, QUESTIONS[task].format(shape=kind), color, shapes)
    if task == "count_kind":
        kind = rng.choice(SHAPES)
        answer = str(sum(s.shape == kind for s in shapes))
        return ImageExample(image, task, QUESTIONS[task].format(shape=kind), answer, shapes)
    if task == "count":
        return ImageExample(image, task, QUESTIONS[task], str(len(shapes)), shapes)
    return ImageExample(image, task, QUESTIONS[task], caption(shapes), shapes)


def all_texts() -> list[str]:
    """Every question and every answer word the generator can produce: what a tokenizer is learned from."""
    texts = [QUESTIONS["count"], QUESTIONS["caption"], QUESTIONS["glyph"], *GLYPHS, *COLORS, *map(str, range(5))]
    texts += [QUESTIONS[t].format(shape=s) for t in ("count_kind", "color") for s in SHAPES]
    texts += [f"{n} {c} {s}{'s' if n > 1 else ''}, " for n in range(1, 5) for c in COLORS for s in SHAPES]
    return texts
