"""The release's tensor names, and how each one lands in a K3Model (SPEC §1).

A K3Model's state_dict already carries the released names under the text-only prefix (`model.*`,
`lm_head.weight`). A model folder differs from it in three ways, all handled here:
- the prefix: text-only `model.` / `lm_head.`, or the multimodal release's `language_model.model.` /
  `language_model.lm_head.`, whose `vision_tower.*` and `mm_projector.*` are loaded into a model built with
  the config's vision_config (k3.model.vision), or skipped with text_only;
- `A_log` padded to 128 values per KDA layer (the first num_heads used, the rest zero), or Kimi Linear's
  [1, 1, num_heads, 1];
- a transformers-saved Kimi Linear folder's dense first layer under the MoE's name
  (`block_sparse_moe.gate_proj`, not `mlp.gate_proj`: TRANSFORMERS_DENSE);
- MXFP4-packed routed experts: `experts.{e}.w1|w2|w3.weight_packed` uint8 [out, in/2] and
  `.weight_scale` uint8 [out, in/32] in place of `.weight` [out, in].
`plan_load` decides all of it from the headers and the config alone, so every name and shape is checked
before a tensor is read.
"""

import re
from dataclasses import dataclass, field

import torch

from k3.hub.folder import ModelFolderError, TensorInfo, _names
from k3.model.names import RELEASED_A_LOG_SIZE, legacy_key
from k3.quant.mx import BLOCK_SIZE

PREFIXES = {"model": "", "language_model": "language_model."}
UNBUILT_PARTS = ("vision_tower.", "mm_projector.")  # multimodal parts, built only with a vision_config
EXPERT_WEIGHT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# transformers (5.23+) saves a Kimi Linear model by undoing its load-time renames, one of which is
# `.block_sparse_moe.` -> `.mlp.` for every layer; so the dense first layer's MLP comes back as
# `block_sparse_moe.{gate,up,down}_proj`. In a dense layer that name is the `mlp.*` k3 builds.
TRANSFORMERS_DENSE = re.compile(r"(layers\.\d+\.)block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")


def release_name(k3_name: str, prefix: str) -> str:
    """A K3Model state_dict key under the folder prefix `prefix` ("model" or "language_model"); the vision
    tower and projector keep their top-level names (`vision_tower.*`, `mm_projector.*`) as in the release."""
    return k3_name if k3_name.startswith(UNBUILT_PARTS) else PREFIXES[prefix] + k3_name


def detect_prefix(names) -> str:
    """'language_model' when the tensors carry the multimodal prefix, else 'model'; a mix is an error."""
    multimodal = [n for n in names if n.startswith(("language_model.", *UNBUILT_PARTS))]
    text_only = [n for n in names if n.startswith(("model.", "lm_head."))]
    if multimodal and text_only:
        raise ModelFolderError(
            f"tensors under both prefixes: {_names(text_only, 3)} (text-only) and "
            f"{_names(multimodal, 3)} (multimodal); a folder uses one"
        )
    return "language_model" if multimodal else "model"


@dataclass
class Placement:
    """Where one folder tensor goes: `kind` is 'copy' (same shape), 'a_log' (plain or padded), or 'packed' /
    'scale' (the two halves of an MXFP4 expert weight, written as `target` once both are read)."""

    target: str
    kind: str


@dataclass
class LoadPlan:
    placements: dict[str, Placement]  # folder tensor name -> where it goes
    skipped: list[str] = field(default_factory=list)  # unbuilt parts, skipped with text_only
    legacy: list[str] = field(default_factory=list)  # pre-release AttnRes names, mapped


def plan_load(tensors: dict[str, TensorInfo], expected: dict[str, torch.Size], text_only: bool = False) -> LoadPlan:
    """Match a folder's tensors (from headers) to a model's state_dict shapes `expected`; every problem
    found is an error naming the keys."""
    prefix = detect_prefix(tensors)
    head = PREFIXES[prefix]
    plan = LoadPlan({})
    unknown, wrong = [], []
    halves: dict[str, dict[str, str]] = {}
    for name, info in tensors.items():
        vision = name.startswith(UNBUILT_PARTS)
        if vision and (text_only or not any(k.startswith(UNBUILT_PARTS) for k in expected)):
            plan.skipped.append(name)  # a language model without the tower: text_only, or a config without it
            continue
        if not vision and not name.startswith((head + "model.", head + "lm_head.")):
            unknown.append(name)
            continue
        k3_name = name if vision else legacy_key(name[len(head) :])
        if not vision and k3_name != name[len(head) :]:
            plan.legacy.append(name)
        for suffix, kind in ((".weight_packed", "packed"), (".weight_scale", "scale")):
            if k3_name.endswith(suffix):
                target = k3_name[: -len(suffix)] + ".weight"
                if not EXPERT_WEIGHT.search(target) or target not in expected:
                    unknown.append(name)
                    break
                if info.dtype != "U8":
                    wrong.append(f"{name}: dtype {info.dtype}, packed MXFP4 tensors are U8")
                out, n_in = expected[target]
                want = (out, n_in // 2) if kind == "packed" else (out, n_in // BLOCK_SIZE)
                if n_in % BLOCK_SIZE or info.shape != want:
                    wrong.append(
                        f"{name}: shape {list(info.shape)}, the packed form of a [{out}, {n_in}] weight is "
                        f"{list(want)}"
                        + (f" (in-features must be a multiple of {BLOCK_SIZE})" if n_in % BLOCK_SIZE else "")
                    )
                halves.setdefault(target, {})[kind] = name
                plan.placements[name] = Placement(target, kind)
                break
        else:
            dense = TRANSFORMERS_DENSE.sub(r"\1mlp.\2", k3_name)
            if k3_name not in expected and dense in expected:
                k3_name = dense
            if k3_name not in expected:
                unknown.append(name)
                continue
            shape = tuple(expected[k3_name])
            if info.dtype not in FLOAT_DTYPES:
                wrong.append(f"{name}: dtype {info.dtype}, expected a floating-point tensor")
            if k3_name.endswith(".A_log") and (
                info.shape in (shape, (1, 1, *shape, 1))
                or (info.shape == (RELEASED_A_LOG_SIZE,) and shape[0] <= RELEASED_A_LOG_SIZE)
            ):
                plan.placements[name] = Placement(k3_name, "a_log")
                continue
            if info.shape != shape:
                padded = (
                    f" or [{RELEASED_A_LOG_SIZE}] (padded), or Kimi Linear's [1, 1, {shape[0]}, 1]"
                    if k3_name.endswith(".A_log")
                    else ""
                )
                wrong.append(f"{name}: shape {list(info.shape)}, the config gives {list(shape)}{padded}")
            plan.placements[name] = Placement(k3_name, "copy")
    for got in halves.values():
        if len(got) != 2:
            lone = next(iter(got.values()))
            wrong.append(f"{lone}: its partner {'.weight_scale' if 'packed' in got else '.weight_packed'} is missing")
    targets = [p.target for p in plan.placements.values()]
    twice = sorted({t for t in targets if targets.count(t) > (2 if t in halves else 1)})
    if twice:
        raise ModelFolderError(
            f"more than one tensor for {_names(twice)} (e.g. both .weight and .weight_packed, "
            f"or an old and a released name)"
        )
    if unknown:
        raise ModelFolderError(
            f"tensors k3 cannot place: {_names(unknown)} (prefix {prefix!r}); the config does not "
            f"build them, or they are misnamed"
        )
    if plan.skipped and not text_only:
        raise ModelFolderError(
            f"{len(plan.skipped)} tensors of parts k3 does not build "
            f"({_names(plan.skipped, 4)}); pass text_only=True (--text-only) to load the language "
            f"model without them"
        )
    if wrong:
        raise ModelFolderError(
            "tensors that do not fit the config: "
            + "; ".join(wrong[:8])
            + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        )
    missing = set(expected) - set(targets)
    if missing:
        raise ModelFolderError(f"tensors the model needs but the folder lacks: {_names(missing)}")
    return plan
