"""The tiny models the GGUF tests export: a k3 init run with random AttnRes queries and router bias, with its
byte tokenizer or a trained one, and text that is hard to split the same way twice."""

import json
from pathlib import Path

import torch

from k3.cli import main
from k3.formats.tokenizer import K3Tokenizer, train_tokenizer

TRICKY = [
    "def f(x):\n    return x**2  # square\n\n\tpass\n",
    "Hello world!!  It's   we're they've I'm you'll he'd 'S DON'T x's it’s '''s",
    "12345 3.14159 1,000,000 x2y3 ²³ ½ Ⅻ ٣٤ 一二三 0x1F",
    "   leading and trailing   ",
    "\n\n\n a\u00a0b a \u3000 b tab\t\tsep\r\n\r\n  \n  x \t x",
    "naïve café 日本語のテキスト 한국어 Ελληνικά русский עברית العربية",
    "emoji 👍🏽 🇺🇸 👨\u200d👩\u200d👧 e\u0301 a\u0308 $$$ ... --> <= !== ;;",
    '{"key": [1, 2.5e-3, null], \'v\': "a b"}  \u2028\u2029\u0085end',
    "",
    " ",
    "x",
]


def trained_tokenizer() -> K3Tokenizer:
    corpus = [t * 3 for t in TRICKY] + ["def g(y):\n    return y + 1\n" * 4, "the cat sat on the mat. " * 6]
    return train_tokenizer(corpus * 4, vocab_size=400)


def make_run(path: Path, tokenizer: K3Tokenizer | None = None, **overrides) -> Path:
    """A tiny run folder whose AttnRes queries and router bias are random (zero at init: their terms would
    vanish), with `tokenizer` in place of k3 init's byte tokenizer when given."""
    args = ["init", "--preset", "tiny", "--out", str(path), "--seed", "3"]
    assert main(args) == 0
    from safetensors.torch import load_file, save_file

    from k3.formats.checkpoint import _sha256, write_meta

    step = path / "step_00000000"
    tensors = load_file(step / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith(("_res_proj.weight", "e_score_correction_bias")):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.5
    save_file(tensors, step / "model.safetensors", metadata={"format": "pt"})
    meta = json.loads((step / "meta.json").read_text())
    meta["sha256"]["model.safetensors"] = _sha256(step / "model.safetensors")
    write_meta(step, meta)
    if tokenizer is not None:
        for found in path.rglob("tokenizer.json"):
            tokenizer.save(found)
    return path
