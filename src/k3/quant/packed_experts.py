"""Routed experts kept MXFP4-packed in memory, as the release stores them, and computed from directly.

An `MXFP4Linear` holds an expert weight as the release's two uint8 buffers (`weight_packed`, `weight_scale`).
Each call dequantises the weight (`.weight` is a property), which is what LatentMoE.experts_forward reads:
resident bytes per weight drop from 4·out·in (fp32) to out·in/2 + out·in/32, 128/17 ≈ 7.5× less.

Packed experts are inference-only: their weights are buffers, not parameters, and a forward in training
mode with gradients enabled raises PackedExpertTrainingError. Putting them into a model, and taking them
out again, is k3.model.quantization's (`pack_experts`, `unpack_experts`, `allocate_packed_experts`): this
package knows nothing of the model.
"""

import torch
import torch.nn.functional as F
from torch import nn

from k3.quant.mx import BLOCK_SIZE, check_packed_mxfp4, pack_mxfp4, unpack_mxfp4


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
    def empty(
        cls,
        out_features: int,
        in_features: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
    ) -> "MXFP4Linear":
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
                "k3.model.quantization.unpack_experts(model) first, or run inference under model.eval() / "
                "torch.no_grad()"
            )
        return unpack_mxfp4(self.weight_packed, self.weight_scale, self.dequant_like.dtype)

    def nbytes(self) -> int:
        return self.weight_packed.nbytes + self.weight_scale.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp4, {self.dequant_like.dtype}"
