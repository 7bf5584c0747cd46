"""A draft folder: what `k3 train-draft` writes and `LLM(..., speculative_model=DIR)` loads.

    draft.json          {"format": "k3-draft-1", "mode", "num_speculative_tokens", "feature_blocks",
                         "base": what the draft was trained against, "training": how, and its acceptance}
    draft.safetensors   the draft's own weights (the shared embedding and LM head are the big model's)

A draft only makes sense on the big model it was trained against: its inputs are that model's block
summaries and its outputs go through that model's LM head. `base` records the big model's shape and a
fingerprint of its embedding and LM head, and loading checks both, so a draft for another model is a
readable error rather than a silent acceptance rate of zero.
"""

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from k3.formats.files import atomic_write
from k3.model.model import K3Model
from k3.spec.draft import DraftModel

FORMAT = "k3-draft-1"
CONFIG_FILE, WEIGHTS_FILE = "draft.json", "draft.safetensors"
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "num_attention_heads",
    "intermediate_size",
)


class DraftFolderError(ValueError):
    """A draft folder that is missing, corrupt, or made for another big model."""


def base_fingerprint(model: K3Model) -> dict:
    """The big model's shape and four statistics of its embedding and LM head (sums and sums of squares in
    fp64): equal for the same weights in any dtype to ~1e-3, different for any other trained model."""
    weights = {"embed": model.model.embed_tokens.weight, "lm_head": model.lm_head.weight}
    stats = {
        f"{name}_{kind}": float(w.detach().double().pow(p).sum())
        for name, w in weights.items()
        for kind, p in (("sum", 1), ("sumsq", 2))
    }
    return {**{f: getattr(model.config, f) for f in SHAPE_FIELDS}, **stats}


def save_draft(draft: DraftModel, big: K3Model, out: str | Path, training: dict | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "mode": draft.mode,
        "num_speculative_tokens": draft.num_speculative_tokens,
        "feature_blocks": list(draft.feature_blocks),
        "base": base_fingerprint(big),
        "training": training or {},
    }
    state = {k: v.detach().float().contiguous() for k, v in draft.state_dict().items()}
    # each file atomically (a kill never leaves a torn one), the weights first: draft.json says the folder is a draft
    atomic_write(out / WEIGHTS_FILE, lambda tmp: save_file(state, str(tmp)))
    atomic_write(out / CONFIG_FILE, json.dumps(meta, indent=1) + "\n")
    return out


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise DraftFolderError(f"speculative model {path}: not a folder (expected a `k3 train-draft --out` folder)")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise DraftFolderError(f"speculative model {path}: no {name}; is it a `k3 train-draft --out` folder?")
    try:
        meta = json.loads((path / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftFolderError(f"speculative model {path}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DraftFolderError(f"speculative model {path}: {CONFIG_FILE} has format {got!r}, expected {FORMAT!r}")
    return meta


def load_draft(path: str | Path, big: K3Model) -> DraftModel:
    """The draft in `path`, checked against `big`, in big's dtype and device, attached to big."""
    path, meta = Path(path), read_meta(path)
    mine, theirs = base_fingerprint(big), meta.get("base", {})
    for field in SHAPE_FIELDS:
        if theirs.get(field) != mine[field]:
            raise DraftFolderError(
                f"speculative model {path} was trained for a big model with {field} = {theirs.get(field)}, "
                f"this one has {mine[field]}: train a draft for this model with `k3 train-draft`"
            )
    for key in (k for k in mine if k not in SHAPE_FIELDS):
        a, b = theirs.get(key), mine[key]
        if a is None or abs(a - b) > 1e-3 * max(1.0, abs(b)):
            raise DraftFolderError(
                f"speculative model {path} was trained against other weights (its big model's {key} is {a}, this "
                f"one's is {b:.6g}): a draft only fits the model it was trained on; run `k3 train-draft`"
            )
    try:
        draft = DraftModel(big.config, meta["mode"], meta["num_speculative_tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise DraftFolderError(f"speculative model {path}: bad {CONFIG_FILE} ({e})") from None
    try:
        state = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise DraftFolderError(f"speculative model {path}: {WEIGHTS_FILE} is corrupt ({e})") from None
    expected = draft.state_dict()
    if state.keys() != expected.keys() or any(state[k].shape != expected[k].shape for k in expected):
        missing, extra = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
        raise DraftFolderError(
            f"speculative model {path}: {WEIGHTS_FILE} does not match its {CONFIG_FILE} "
            f"(missing {missing[:3]}, unexpected {extra[:3]}, or different shapes)"
        )
    draft.load_state_dict(state)
    param = next(big.parameters())
    return draft.to(device=param.device, dtype=param.dtype).eval().attach(big)
