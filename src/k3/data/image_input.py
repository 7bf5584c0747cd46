"""Images as the vision tower takes them: decoded, checked, resized to whole merged patches, normalised.

Every way an image comes in (a file for `k3 generate --image`, a data URL's bytes in a chat request, a
generated example) goes through `load_image` and `image_to_tensor`, so a bad image is refused the same
way everywhere: an ImageError (a ValueError) that says what is wrong — not an image / truncated /
zero-sized / too many pixels / a pixel mode with no RGB reading — and the server turns it into a 400.

Resizing keeps the aspect ratio as closely as whole 28 x 28 cells allow (patch 14, 2x2 merge), at most
`max_tokens` LM tokens per image; an image already a multiple of 28 on both sides and within the budget
is not resampled.
"""

import io
import math
import warnings
from pathlib import Path

import torch
from PIL import Image

from k3.config import VisionConfig

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # what a request or file may hold, encoded
MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # decoded: 8192 x 8192; a larger header is refused before decoding
DEFAULT_MAX_TOKENS = 256  # LM tokens per image after resizing (16 x 16 merged cells of 28 px)
# Pixel modes with a faithful RGB reading; 16/32-bit and float modes ("I", "I;16", "F") have none without a
# choice of scaling k3 does not make for the caller.
RGB_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr", "RGBX", "La")


class ImageError(ValueError):
    """An image that cannot be given to the vision tower; the message says why."""


def load_image(source: bytes | str | Path) -> Image.Image:
    """Decode an image (encoded bytes, or a file path) into a checked RGB Pillow image."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ImageError(f"{path}: no such image file")
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise ImageError(
                f"{path}: {path.stat().st_size:,} bytes, more than the {MAX_IMAGE_BYTES:,} an image may be"
            )
        data, name = path.read_bytes(), str(path)
    else:
        data, name = bytes(source), "the image"
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageError(f"{name}: {len(data):,} bytes, more than the {MAX_IMAGE_BYTES:,} an image may be")
    if not data:
        raise ImageError(f"{name} is empty (0 bytes)")
    declared = _png_size(data)  # Pillow does not identify a PNG without pixels, nor one over its own limit
    if declared is not None:
        _check_size(*declared, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            _check_size(*im.size, name)
            im.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"{name}: too many pixels to decode ({e})") from e
    except Image.UnidentifiedImageError as e:
        raise ImageError(f"{name} is not an image Pillow can read (PNG, JPEG, GIF, WebP, BMP, ...)") from e
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise ImageError(f"{name} is truncated or corrupt: {e}") from e
    return to_rgb(im, name)


def _check_size(w: int, h: int, name: str) -> None:
    if w == 0 or h == 0:
        raise ImageError(f"{name} is {w}x{h} pixels: an image needs at least one pixel each way")
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageError(f"{name} is {w}x{h} pixels, more than the {MAX_IMAGE_PIXELS:,} pixels k3 decodes")


def _png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) a PNG's IHDR declares, or None when data is not a PNG."""
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def to_rgb(im: Image.Image, name: str = "the image") -> Image.Image:
    """RGB; transparency composited over white; modes without an RGB reading refused."""
    if im.mode not in RGB_MODES:
        raise ImageError(
            f"{name} has pixel mode {im.mode!r}, which has no RGB reading k3 can assume; save it as "
            f"8-bit RGB, RGBA or greyscale"
        )
    if im.mode in ("RGBA", "LA", "PA", "La") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def fitted_size(width: int, height: int, config: VisionConfig, max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[int, int]:
    """(width, height) in whole merged cells nearest the image's, scaled down to at most max_tokens tokens."""
    cell_w = config.patch_size * config.merge_kernel_size[1]
    cell_h = config.patch_size * config.merge_kernel_size[0]
    cols, rows = max(1, round(width / cell_w)), max(1, round(height / cell_h))
    if cols * rows > max_tokens:
        scale = math.sqrt(max_tokens / (cols * rows))
        cols, rows = max(1, math.floor(cols * scale)), max(1, math.floor(rows * scale))
        while cols * rows > max_tokens:  # a 1-wide strip can still be over: shorten the long side
            if cols >= rows:
                cols -= 1
            else:
                rows -= 1
    return cols * cell_w, rows * cell_h


def image_to_tensor(im: Image.Image, config: VisionConfig, max_tokens: int = DEFAULT_MAX_TOKENS) -> torch.Tensor:
    """An RGB image -> (3, H, W) float32 in [-1, 1], H and W whole merged cells."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens}: an image is at least one token")
    im = to_rgb(im)
    size = fitted_size(*im.size, config, max_tokens)
    if size != im.size:
        im = im.resize(size, Image.Resampling.BICUBIC)
    pixels = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(im.size[1], im.size[0], 3)
    return pixels.permute(2, 0, 1).float().div(127.5).sub(1.0)
