"""The tiny K3 model the model, runner, prefix-cache and engine tests share."""

import torch

from k3 import K3Config, K3Model


def tiny_model(seed: int = 0, router_bias_std: float = 0.0, **overrides) -> K3Model:
    """float64, eval mode, with the zero-initialised AttnRes queries (and, if asked, the router bias)
    made random so that the terms they control are exercised by every comparison."""
    torch.manual_seed(seed)
    model = K3Model(K3Config.from_preset("tiny", **overrides)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.normal_(std=0.5)
        if router_bias_std:
            for layer in model.model.layers:
                if hasattr(layer, "block_sparse_moe"):
                    layer.block_sparse_moe.gate.e_score_correction_bias.normal_(std=router_bias_std)
    return model.eval()
