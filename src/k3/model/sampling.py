"""Token sampling math shared by plain generation (k3.model.generate) and the serving engine
(k3.serve.sampling, which adds per-request parameters and generators on top).

Shape suffixes: S rows that sample, V vocabulary.
"""

import math

import torch


def filtered_probs(logits_SV: torch.Tensor, top_k_S: torch.Tensor, top_p_S: torch.Tensor) -> torch.Tensor:
    """(S, V) fp32 logits already divided by temperature -> (S, V) probabilities after top-k, then top-p.

    top_k_S (S,) int64 in [1, V]; top_p_S (S,) fp32 in (0, 1]. Top-p keeps the smallest set of most
    likely tokens (of the top-k renormalised distribution) whose mass reaches top_p; the first always
    stays. Ties are broken by vocabulary index, as argmax does, so top_k=1 is exactly greedy.
    """
    V = logits_SV.shape[-1]
    sorted_SV, order_SV = logits_SV.sort(dim=-1, descending=True, stable=True)
    drop_SV = torch.arange(V, device=logits_SV.device) >= top_k_S[:, None]
    sorted_p_SV = sorted_SV.masked_fill(drop_SV, -math.inf).softmax(dim=-1)
    # drop a token once the mass before it already reaches top_p; rows with top_p = 1 skip this, since
    # an fp32 cumsum can reach 1.0 early and would cut a tail that top_p = 1 promises to keep
    mass_before_SV = sorted_p_SV.cumsum(dim=-1) - sorted_p_SV
    drop_SV |= (mass_before_SV >= top_p_S[:, None]) & (top_p_S < 1)[:, None]
    # the most likely token stays for any top_p > 0: a top_p that rounds to 0 in fp32 (5e-324) would drop it too
    drop_SV[:, 0] = False
    keep_SV = torch.zeros_like(drop_SV).scatter(-1, order_SV, ~drop_SV)
    return logits_SV.masked_fill(~keep_SV, -math.inf).softmax(dim=-1)
