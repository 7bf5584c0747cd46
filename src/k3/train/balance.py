"""Router-bias balancing between optimiser steps (SPEC §2.6): Quantile Balancing and the fixed-step baseline.

The bias b (each router's `e_score_correction_bias` buffer) only selects experts; it is not a parameter
and no gradient reaches it. The trainer owns it, once per optimiser step:

    balancer = QuantileBalancer(model)        # binds the model's routers, in layer order
    for ids, labels in micro_batches:
        out = model(ids, labels=labels)
        balancer.observe(out.routing)         # one RouterOutput per MoE layer
    maxvio = balancer.update()                # on every rank: all-reduce, write each router's bias, reset

Nothing here runs by itself, so the bias is frozen at inference.

Shape suffixes: L MoE layers, T tokens, E routed experts, B histogram bins.
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from k3.model.router import Router, RouterOutput

BALANCERS = ("quantile", "fixed", "none")  # `k3 train --balancer`: Quantile Balancing, the fixed step, LoadMeter


def moe_routers(model_or_routers: nn.Module | Sequence[Router]) -> list[Router]:
    """The routers of a model in layer order (`modules()` follows registration order, as K3Output.routing does)."""
    if isinstance(model_or_routers, nn.Module):
        return [m for m in model_or_routers.modules() if isinstance(m, Router)]
    return list(model_or_routers)


def max_violation(loads_E: torch.Tensor) -> float:
    """MaxVio = (max load − mean load) / mean load; 0 when perfectly balanced (or nothing was routed)."""
    loads_E = loads_E.double()
    mean = loads_E.mean()
    return 0.0 if mean == 0 else ((loads_E.max() - mean) / mean).item()


def histogram(r_TE: torch.Tensor, lo, hi, num_bins: int) -> torch.Tensor:
    """Per-expert counts of r over B equal bins spanning [lo, hi]; values outside land in the edge bins.

    r_TE (T, E) float; lo, hi numbers or 0-d tensors -> counts_EB (E, B) int64. One scatter-add for all
    T·E values: value (t, e) in bin j is counted at flat index e·B + j.
    """
    E = r_TE.shape[1]
    lo, hi = (torch.as_tensor(v, dtype=r_TE.dtype, device=r_TE.device) for v in (lo, hi))
    bins_TE = ((r_TE - lo) * (num_bins / (hi - lo))).floor_().clamp_(0, num_bins - 1).long()
    flat = (bins_TE + torch.arange(E, device=r_TE.device) * num_bins).flatten()
    counts = torch.zeros(E * num_bins, dtype=torch.int64, device=r_TE.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat)).view(E, num_bins)


def histogram_quantile(counts_EB: torch.Tensor, lo, hi, q) -> torch.Tensor:
    """The value x at which q of the counted values lie below x, per row, from a histogram over [lo, hi].

    counts_EB (..., E, B); lo, hi, q broadcastable to (..., E) -> x (..., E) float64.
    With C_j the cumulative count through bin j (width w = (hi − lo)/B), j is the first bin with C_j ≥ q.
    The values inside a bin are unknown, so they are taken as spread evenly over it: the empirical CDF is
    linear between bin edges, and it reaches q at

        x = lo + w · (j + (q − C_{j−1}) / n_j)          n_j = C_j − C_{j−1} > 0

    The true q-th value lies in the same bin, so x is within one bin width of it.
    """
    B = counts_EB.shape[-1]
    counts = counts_EB.double()
    dev = counts.device
    lo, hi = torch.as_tensor(lo, dtype=torch.float64, device=dev), torch.as_tensor(hi, dtype=torch.float64, device=dev)
    q = torch.as_tensor(q, dtype=torch.float64, device=dev).expand(counts.shape[:-1]).unsqueeze(-1)
    cum = counts.cumsum(-1)
    j = torch.searchsorted(cum, q.contiguous()).clamp_(max=B - 1)  # first bin with C_j ≥ q
    n_j = counts.gather(-1, j)
    frac = ((q - (cum.gather(-1, j) - n_j)) / n_j.clamp(min=1)).clamp(0, 1)
    return lo + (hi - lo) / B * (j + frac).squeeze(-1)


def picked_TE(out: RouterOutput) -> torch.Tensor:
    """(T, E) bool: whether token t picked expert e."""
    picked = torch.zeros_like(out.scores_TE, dtype=torch.bool)
    return picked.scatter_(1, out.experts_TK, True)


def kth_score_T(out: RouterOutput, router: Router) -> torch.Tensor:
    """(T,) each token's K-th largest biased score (its lowest pick), under the router's current bias."""
    bias_E = router.e_score_correction_bias.to(out.scores_TE.dtype)
    return (out.scores_TE.gather(1, out.experts_TK) + bias_E[out.experts_TK]).min(-1).values


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place when torch.distributed is running (every rank must call it); else unchanged."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class Balancer:
    """What both rules share: the bound routers, per-layer loads summed over one step's micro-batches,
    and MaxVio of those loads. `update()` must be called on every rank (it all-reduces)."""

    def __init__(self, model_or_routers: nn.Module | Sequence[Router]):
        self.routers = moe_routers(model_or_routers)
        if not self.routers:
            raise ValueError("no Router found: pass a model with LatentMoE layers or a list of routers")
        sizes = {r.weight.shape[0] for r in self.routers}
        if len(sizes) != 1:
            raise ValueError(f"all routers must have the same number of experts, got {sorted(sizes)}")
        self.num_experts = sizes.pop()
        self.last_maxvio: list[float] = []  # per MoE layer, from the last update's step
        self.loads_LE: torch.Tensor | None = None  # None between steps

    @property
    def device(self) -> torch.device:
        return self.routers[0].e_score_correction_bias.device

    def biases(self) -> list[torch.Tensor]:
        return [r.e_score_correction_bias for r in self.routers]

    @torch.no_grad()
    def observe(self, routing: Sequence[RouterOutput]) -> None:
        """Accumulate one micro-batch: `routing` holds one RouterOutput per bound router, in the same order."""
        if len(routing) != len(self.routers):
            raise ValueError(
                f"got routing for {len(routing)} layers but the balancer holds {len(self.routers)} routers; "
                "pass K3Output.routing of the model the balancer was built from"
            )
        if self.loads_LE is None:
            self._begin_step()
        for layer, out in enumerate(routing):
            self.loads_LE[layer] += out.loads_E.to(self.device)
            self._observe_layer(layer, out)

    def update(self) -> list[float]:
        """Set every router's bias from this step's statistics, reset them, and return MaxVio per layer."""
        raise NotImplementedError

    def _begin_step(self) -> None:
        self.loads_LE = torch.zeros(len(self.routers), self.num_experts, dtype=torch.int64, device=self.device)

    def _observe_layer(self, layer: int, out: RouterOutput) -> None:
        pass

    def _end_step(self, loads_LE: torch.Tensor) -> list[float]:
        self.last_maxvio = [max_violation(loads_E) for loads_E in loads_LE.cpu()]
        self.loads_LE = None
        return self.last_maxvio

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain numbers only (safetensors + JSON). Between steps it holds no tensors."""
        return {} if self.loads_LE is None else {"loads_LE": self.loads_LE.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loads_LE = None
        if "loads_LE" in state:
            loads = state["loads_LE"]
            if tuple(loads.shape) != (len(self.routers), self.num_experts):
                raise ValueError(
                    f"balancer state has loads of shape {tuple(loads.shape)}, expected "
                    f"{(len(self.routers), self.num_experts)}: the checkpoint is from a different model"
                )
            self.loads_LE = loads.to(self.device, torch.int64).clone()


class QuantileBalancer(Balancer):
    """Quantile Balancing (SPEC §2.6). For token t the cutoff c_t is its (K+1)-th largest biased score, so
    expert e is picked by t when s_te + b_e > c_t, i.e. when b_e exceeds the required bias

        r_te = c_t − s_te                               (RouterOutput.required_bias_TE)

    With q = m·K/E the target load of m tokens, b_e ← the K/E quantile of r_·e over the step (q of them
    below it, so about q tokens pick e), then b ← b − mean(b) (a shift common to all experts changes no
    choice). The quantile comes from a per-expert histogram of r over [min b − 1, max b + 1], which holds
    every r because c_t = s_tj + b_j for some j and sigmoid scores lie in (0, 1); its bin counts are summed
    over micro-batches and ranks, so all ranks set the same bias.

    Two approximations keep one update from a skewed start off the exact target; repeated steps converge.
    Each quantile assumes the other experts' biases stay put, but all move at once. And c_t is the score
    to beat only for tokens that already pick e: a token that does not must beat its K-th biased score,
    which is higher, so r_te undercounts what an expert must gain (for the (K+1)-th expert r_te = b_e
    exactly, an atom at the current bias). `exact_cutoff=True` measures those tokens against the K-th
    score instead, which makes each expert's quantile exact with the others held fixed; it is off by
    default because SPEC §2.6 defines the cutoff as the (K+1)-th.
    """

    def __init__(
        self, model_or_routers: nn.Module | Sequence[Router], num_bins: int = 1000, exact_cutoff: bool = False
    ):
        super().__init__(model_or_routers)
        if num_bins < 1:
            raise ValueError(f"num_bins must be positive, got {num_bins}")
        self.num_bins, self.exact_cutoff = num_bins, exact_cutoff
        self.top_k = torch.tensor([float(r.top_k) for r in self.routers], dtype=torch.float64)
        self.counts_LEB: torch.Tensor | None = None
        self.lo_L: torch.Tensor | None = None  # histogram range per layer, fixed at the step's first observe
        self.hi_L: torch.Tensor | None = None

    def _begin_step(self) -> None:
        super()._begin_step()
        L, E, B = len(self.routers), self.num_experts, self.num_bins
        self.counts_LEB = torch.zeros(L, E, B, dtype=torch.int64, device=self.device)
        bias_LE = torch.stack(self.biases()).double()
        self.lo_L, self.hi_L = bias_LE.min(-1).values - 1, bias_LE.max(-1).values + 1

    def _observe_layer(self, layer: int, out: RouterOutput) -> None:
        r_TE = out.required_bias_TE().detach()
        if self.exact_cutoff:
            beat_TE = kth_score_T(out, self.routers[layer])[:, None] - out.scores_TE.detach()
            r_TE = torch.where(picked_TE(out), r_TE, beat_TE)
        r_TE = r_TE.to(self.device)
        self.counts_LEB[layer] += histogram(r_TE, self.lo_L[layer], self.hi_L[layer], self.num_bins)

    @torch.no_grad()
    def update(self) -> list[float]:
        if self.counts_LEB is None:  # nothing observed since the last update
            return []
        counts_LEB, loads_LE = all_reduce_sum(self.counts_LEB), all_reduce_sum(self.loads_LE)
        m_L = counts_LEB[:, 0].sum(-1).double()  # every token adds one required bias to each expert
        q_L = m_L * self.top_k.to(self.device) / self.num_experts
        bias_LE = histogram_quantile(counts_LEB, self.lo_L[:, None], self.hi_L[:, None], q_L[:, None])
        bias_LE -= bias_LE.mean(-1, keepdim=True)
        for router, bias_E, m in zip(self.routers, bias_LE, m_L.tolist(), strict=True):
            if m > 0:  # a layer that saw no tokens has no quantile: keep its bias
                router.e_score_correction_bias.copy_(bias_E)
        self.counts_LEB = self.lo_L = self.hi_L = None
        return self._end_step(loads_LE)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"num_bins": self.num_bins, **super().state_dict()}
        if self.counts_LEB is not None:
            state |= {
                "counts_LEB": self.counts_LEB.cpu().clone(),
                "lo_L": self.lo_L.cpu().clone(),
                "hi_L": self.hi_L.cpu().clone(),
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("num_bins", self.num_bins)) != self.num_bins:
            raise ValueError(
                f"balancer state has num_bins = {state['num_bins']} but this balancer has {self.num_bins}; "
                "build the QuantileBalancer with the checkpoint's num_bins"
            )
        super().load_state_dict(state)
        self.counts_LEB = self.lo_L = self.hi_L = None
        if "counts_LEB" in state:
            if self.loads_LE is None:
                raise ValueError("balancer state has histograms but no loads_LE: the checkpoint is incomplete")
            self.counts_LEB = state["counts_LEB"].to(self.device, torch.int64).clone()
            self.lo_L = state["lo_L"].to(self.device, torch.float64)
            self.hi_L = state["hi_L"].to(self.device, torch.float64)


class FixedStepBalancer(Balancer):
    """The baseline (SPEC §2.6): b_e ← b_e + u · sign(mean load − load_e), loads summed over the step
    (and over ranks). Each step moves every bias by exactly u, or not at all for an expert at the mean."""

    def __init__(self, model_or_routers: nn.Module | Sequence[Router], u: float = 1e-3):
        super().__init__(model_or_routers)
        self.u = u

    @torch.no_grad()
    def update(self) -> list[float]:
        if self.loads_LE is None:
            return []
        loads_LE = all_reduce_sum(self.loads_LE)
        loads = loads_LE.double()
        step_LE = self.u * torch.sign(loads.mean(-1, keepdim=True) - loads)
        for router, step_E in zip(self.routers, step_LE, strict=True):
            router.e_score_correction_bias.add_(step_E.to(router.e_score_correction_bias.dtype))
        return self._end_step(loads_LE)

    def state_dict(self) -> dict[str, Any]:
        return {"u": self.u, **super().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.u = float(state.get("u", self.u))
        super().load_state_dict(state)


class LoadMeter(Balancer):
    """No balancing (`k3 train --balancer none`): the bias stays where it is, but MaxVio is still measured
    from the step's loads, so an unbalanced run logs the same metric as the two rules it is compared with."""

    @torch.no_grad()
    def update(self) -> list[float]:
        if self.loads_LE is None:
            return []
        return self._end_step(all_reduce_sum(self.loads_LE))
