"""Routed experts kept MXFP4-packed in memory, as the release stores them, and computed from directly.

`pack_experts(model)` replaces every routed expert's `w1`/`w2`/`w3` (bias-free nn.Linear) with an
`MXFP4Linear` that holds the release's two uint8 buffers, so the state_dict keys become exactly
`...block_sparse_moe.experts.{e}.w1.weight_packed` and `.weight_scale`. Each call dequantises the expert's
weight (`.weight` is a property), which is what LatentMoE.experts_forward reads: resident bytes per
weight drop from 4·out·in (fp32) to out·in/2 + out·in/32, 128/17 ≈ 7.5× less.

Packed experts are inference-only: their weights are buffers, not parameters, and a forward in training
mode with gradients enabled raises PackedExpertTrainingError. `unpack_experts(model)` turns them back into
trainable nn.Linear layers holding the dequantised weights.

A loader that reads packed bytes (k3.hub, `quantization="mxfp4"`) calls `allocate_packed_experts(model)` on a
meta-device model first: the experts become empty MXFP4Linear slots of the packed shapes, and the folder's
bytes are copied into them, so no dense expert weight ever exists.
"""

import torch
import torch.nn.functional as F
from torch import nn

from k3.quant.mx import BLOCK_SIZE, check_packed_mxfp4, pack_mxfp4, unpack_mxfp4

EXPERT_PROJECTIONS = ("w1", "w2", "w3")  # gate, down, up


class PackedExpertTrainingError(RuntimeError):
    """A training step reached MXFP4-packed experts, which have no parameters to train."""


class MXFP4Linear(nn.Module):
    """y = x · Wᵀ with W (out, in) stored as weight_packed (out, in/2) uint8 + weight_scale (out, in/32)
    uint8 and dequantised on every use into the dtype (and device) of the module's float state, which
    follows model.to(...) like any other tensor."""

    def __init__(self, weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        check_packed_mxfp4(weight_packed, weight_scale)
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("weight_scale", weight_scale)
        # An empty float buffer, not saved, carries the dequantisation dtype and device through .to()/.double().
        self.register_buffer("dequant_like", torch.empty(0, dtype=dtype, device=weight_packed.device), persistent=False)

    @classmethod
    def empty(cls, out_features: int, in_features: int, dtype: torch.dtype = torch.float32,
              device: str | torch.device | None = None) -> "MXFP4Linear":  # fmt: skip
        """Uninitialised buffers for an (out_features, in_features) weight, for a loader to fill."""
        packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
        scale = torch.empty(out_features, in_features // BLOCK_SIZE, dtype=torch.uint8, device=device)
        return cls(packed, scale, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "MXFP4Linear":
        if linear.bias is not None:
            raise ValueError("MXFP4Linear packs bias-free layers only (routed experts have no bias)")
        packed, scale = pack_mxfp4(linear.weight.detach())
        return cls(packed, scale, linear.weight.dtype)

    @property
    def in_features(self) -> int:
        return 2 * self.weight_packed.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight_packed.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """(out, in) dequantised, in the module's float dtype; a fresh tensor every call."""
        if self.training and torch.is_grad_enabled():
            raise PackedExpertTrainingError(
                "routed experts are MXFP4-packed (buffers, not parameters) and cannot be trained; call "
                "k3.quant.unpack_experts(model) first, or run inference under model.eval() / torch.no_grad()"
            )
        return unpack_mxfp4(self.weight_packed, self.weight_scale, self.dequant_like.dtype)

    def nbytes(self) -> int:
        return self.weight_packed.nbytes + self.weight_scale.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp4, {self.dequant_like.dtype}"


def _routed_projections(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """Every routed expert projection as (qualified name, owning expert, attribute, layer)."""
    from k3.model.moe import LatentMoE  # deferred: k3.model.moe imports k3.quant (QAT), not the reverse

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
    todo = [(name, expert, attr, layer) for name, expert, attr, layer in _routed_projections(model)
            if not isinstance(layer, MXFP4Linear)]  # fmt: skip
    for name, _, _, layer in todo:
        if not isinstance(layer, nn.Linear) or layer.bias is not None:
            raise ValueError(f"{name}: only bias-free nn.Linear experts can be packed, got {layer}")
        if layer.in_features % BLOCK_SIZE:
            raise ValueError(f"{name}: in_features {layer.in_features} is not a multiple of the MXFP4 block "
                             f"size {BLOCK_SIZE}, so this model's experts cannot be packed")  # fmt: skip
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
