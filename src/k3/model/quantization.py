"""A model's routed experts quantised: the helpers that walk a K3Model for k3.quant's formats.

k3.quant holds the codecs and packed formats (MX codecs, MXFP4Linear, the QAT quantisers) and knows nothing
of the model; these functions find every LatentMoE's expert projections and change them:

- `set_expert_quantization(model, "mxfp4" | None)`: the function the experts compute (QAT, or PTQ serving).
- `pack_experts(model)` replaces every routed expert's `w1`/`w2`/`w3` (bias-free nn.Linear) with a
  k3.quant.MXFP4Linear holding the release's two uint8 buffers, so the state_dict keys become exactly
  `...block_sparse_moe.experts.{e}.w1.weight_packed` and `.weight_scale`; `unpack_experts(model)` turns them
  back into trainable nn.Linear layers holding the dequantised weights.
- `allocate_packed_experts(model)`, for a loader that reads packed bytes (k3.hub, `quantization="mxfp4"`), on a
  meta-device model: the experts become empty MXFP4Linear slots of the packed shapes, and the folder's bytes
  are copied into them, so no dense expert weight ever exists.
- `routed_expert_bytes(model)`, `routed_expert_numel(model)`: what the experts hold now.
"""

from dataclasses import replace

import torch
from torch import nn

from k3.model.moe import LatentMoE
from k3.quant.mx import BLOCK_SIZE, unpack_mxfp4
from k3.quant.packed_experts import MXFP4Linear

EXPERT_PROJECTIONS = ("w1", "w2", "w3")  # gate, down, up


def set_expert_quantization(model: nn.Module, expert_quantization: str | None):
    """Make `model` (a K3Model) compute its routed experts with `expert_quantization` (None or "mxfp4"):
    its config is replaced by one that records it (what checkpoints and exports write) and every LatentMoE
    follows it. Returns the new config. This is how QAT starts, from step 0 or from a full-precision
    checkpoint, and how a full-precision model is served quantised after training (PTQ)."""
    config = replace(model.config, expert_quantization=expert_quantization)  # validates the value
    model.config = config
    for module in model.modules():
        if isinstance(module, LatentMoE):
            module.quantization = expert_quantization
    return config


def _routed_projections(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """Every routed expert projection as (qualified name, owning expert, attribute, layer)."""
    found = []
    for moe_name, module in model.named_modules():
        if isinstance(module, LatentMoE):
            for e, expert in enumerate(module.experts):
                for attr in EXPERT_PROJECTIONS:
                    prefix = f"{moe_name}." if moe_name else ""
                    found.append((f"{prefix}experts.{e}.{attr}", expert, attr, getattr(expert, attr)))
    return found


def _nbytes(layer: nn.Module) -> int:
    return layer.nbytes() if isinstance(layer, MXFP4Linear) else layer.weight.nbytes


def routed_expert_bytes(model: nn.Module) -> int:
    """Bytes the routed experts' weights occupy now (packed or not) in every LatentMoE of `model`."""
    return sum(_nbytes(layer) for *_, layer in _routed_projections(model))


def routed_expert_numel(model: nn.Module) -> int:
    """Weights (out·in summed) of the routed experts of `model`, packed or not: 4× this is their fp32 size."""
    return sum(layer.out_features * layer.in_features for *_, layer in _routed_projections(model))


def _dense_packable(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """The routed expert projections not packed yet, each checked to be packable (before any is changed)."""
    todo = [found for found in _routed_projections(model) if not isinstance(found[3], MXFP4Linear)]
    for name, _, _, layer in todo:
        if not isinstance(layer, nn.Linear) or layer.bias is not None:
            raise ValueError(f"{name}: only bias-free nn.Linear experts can be packed, got {layer}")
        if layer.in_features % BLOCK_SIZE:
            raise ValueError(
                f"{name}: in_features {layer.in_features} is not a multiple of the MXFP4 block size {BLOCK_SIZE}, "
                "so this model's experts cannot be packed"
            )
    return todo


def allocate_packed_experts(model: nn.Module) -> int:
    """Replace every dense routed expert projection of `model` with an empty MXFP4Linear of its shape, on
    the device of its weight and in its dtype (on the meta device: no memory), for a loader to fill with
    packed bytes. The dense weights' values are discarded. Returns the number of projections replaced."""
    todo = _dense_packable(model)
    for _, expert, attr, layer in todo:
        slot = MXFP4Linear.empty(layer.out_features, layer.in_features, layer.weight.dtype, layer.weight.device)
        slot.train(layer.training)
        setattr(expert, attr, slot)
    return len(todo)


@torch.no_grad()
def pack_experts(model: nn.Module) -> int:
    """Pack every routed expert projection of `model` (a K3Model, or any module holding LatentMoEs) to
    MXFP4 in place; already packed ones are left as they are. Returns the bytes saved. All layers are
    checked before any is replaced, so a model that cannot be packed is left untouched."""
    todo = _dense_packable(model)
    saved = 0
    for _, expert, attr, layer in todo:
        packed = MXFP4Linear.from_linear(layer)
        packed.train(layer.training)
        saved += _nbytes(layer) - packed.nbytes()
        setattr(expert, attr, packed)
    return saved


@torch.no_grad()
def unpack_experts(model: nn.Module) -> int:
    """Turn every packed routed expert projection back into a trainable bias-free nn.Linear holding
    the dequantised weight (in the packed module's float dtype). Returns the bytes added."""
    added = 0
    for _, expert, attr, layer in _routed_projections(model):
        if isinstance(layer, MXFP4Linear):
            weight = unpack_mxfp4(layer.weight_packed, layer.weight_scale, layer.dequant_like.dtype)
            linear = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
            linear.weight = nn.Parameter(weight)
            linear.train(layer.training)
            added += weight.nbytes - layer.nbytes()
            setattr(expert, attr, linear)
    return added
