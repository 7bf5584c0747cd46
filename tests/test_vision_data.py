"""The generated image-text examples (k3.data.images) and the checked image input (k3.data.image_input)."""

import io
import struct
import zlib

import pytest
import torch
from PIL import Image

from k3.config import VisionConfig
from k3.data.image_input import ImageError, fitted_size, image_to_tensor, load_image
from k3.data.images import COLORS, HELD_OUT_PAIRS, HELD_OUT_SIZES, TRAIN_SIZES, caption, example


def png_bytes(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height (8-bit RGB) and that holds no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


def test_examples_are_deterministic_and_the_splits_differ():
    a, b = example("train", 7), example("train", 7)
    assert a.image.tobytes() == b.image.tobytes() and (a.question, a.answer) == (b.question, b.answer)
    firsts = [example(split, i).image.tobytes() for split in ("train", "eval") for i in range(5)]
    assert len(set(firsts)) == 10
    assert example("train", 7, seed=1).image.tobytes() != a.image.tobytes()


def test_training_never_sees_the_held_out_sizes_and_pairs():
    tasks = set()
    for i in range(300):
        ex = example("train", i)
        tasks.add(ex.task)
        assert (ex.image.height, ex.image.width) in TRAIN_SIZES
        assert not any((s.color, s.shape) in HELD_OUT_PAIRS for s in ex.shapes)
    assert tasks == {"count", "count_kind", "color", "caption", "glyph"}
    for i in range(60):
        sized, paired = example("eval-sizes", i), example("eval-pairs", i)
        assert (sized.image.height, sized.image.width) in HELD_OUT_SIZES
        assert paired.glyph is not None or any((s.color, s.shape) in HELD_OUT_PAIRS for s in paired.shapes)


def test_answers_match_what_is_drawn():
    checked = 0
    for i in range(200):
        ex = example("eval", i)
        for s in ex.shapes:  # each shape's own colour at its cell's centre
            assert ex.image.getpixel((s.col * 28 + 14, s.row * 28 + 14)) == COLORS[s.color]
        if ex.task == "count":
            assert ex.answer == str(len(ex.shapes))
        elif ex.task == "caption":
            assert ex.answer == caption(ex.shapes)
        elif ex.task == "color":
            kind = ex.question.split()[-1].rstrip("?")
            assert [s.color for s in ex.shapes if s.shape == kind] == [ex.answer]
        elif ex.task == "glyph":  # black ink somewhere
            assert (0, 0, 0) in {c for _, c in ex.image.getcolors(1 << 16)}
        checked += 1
    assert checked == 200
    assert caption(example("train", 0).shapes) or example("train", 0).glyph


def test_bad_images_are_clear_value_errors(tmp_path):
    good = png_bytes(Image.new("RGB", (40, 30), (10, 20, 30)))
    with pytest.raises(ImageError, match="truncated or corrupt"):
        load_image(good[: len(good) // 2])
    with pytest.raises(ImageError, match="0x5 pixels"):
        load_image(png_header(0, 5))
    with pytest.raises(ImageError, match="100000x100000 pixels, more than"):
        load_image(png_header(100_000, 100_000))
    big = Image.new("L", (9000, 9000))  # decodable, but over k3's limit: refused from the header
    with pytest.raises(ImageError, match="9000x9000 pixels, more than"):
        load_image(png_bytes(big))
    with pytest.raises(ImageError, match="pixel mode 'I;16'"):
        load_image(png_bytes(Image.new("I;16", (8, 8))))
    with pytest.raises(ImageError, match="not an image"):
        load_image(b"hello, not a picture")
    with pytest.raises(ImageError, match="empty"):
        load_image(b"")
    with pytest.raises(ImageError, match="no such image file"):
        load_image(tmp_path / "missing.png")
    assert issubclass(ImageError, ValueError)


def test_image_tensors_fit_whole_merged_patches():
    v = VisionConfig()
    rgba = Image.new("RGBA", (56, 28), (255, 0, 0, 0))  # fully transparent: white after compositing
    t = image_to_tensor(load_image(png_bytes(rgba)), v)
    assert t.shape == (3, 28, 56) and torch.equal(t, torch.ones_like(t))
    assert fitted_size(100, 30, v) == (112, 28)  # nearest whole cells
    w, h = fitted_size(4000, 1000, v, max_tokens=64)
    assert (w // 28) * (h // 28) <= 64 and w > h
    assert fitted_size(10_000, 10, v, max_tokens=8) == (8 * 28, 28)
    grey = image_to_tensor(Image.new("L", (28, 28), 0), v)
    assert torch.equal(grey, -torch.ones(3, 28, 28))
