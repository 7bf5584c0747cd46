"""The routing demo's numbers (SPEC §5): successive batches of synthetic, skewed router scores routed by k3's own
Router, the bias set between batches by k3's own balancers (SPEC §2.6). No web framework here: the page's JSON
endpoint, the stdlib server and `k3 plot routing` all call `route_batches` or `route_query`.

Shape suffixes: T tokens of one batch, E routed experts.

The scores: router logits z_te ~ N(0, 1) + skew · p_e, where p_e are E evenly spaced popularities from +1 to −1
in an order fixed by the seed, so a larger skew makes a few experts hot and a few cold. The Router gets the
logits as its input x_TE and an identity weight, so s = sigmoid(x W^T) = sigmoid(z) and everything after it
(bias, top-k, cutoff, loads) is the training code path, in fp32 as in training. Batch i's noise is the i-th draw
of one generator seeded by `seed`, so asking for n + 1 batches repeats the first n exactly.
"""

import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields

import torch

from k3.model.router import Router
from k3.train.balance import Balancer, FixedStepBalancer, QuantileBalancer, max_violation

RULES = {
    "topk": "plain top-k (no bias)",
    "fixed": "fixed-step bias, b ← b + u·sign(mean load − load)",
    "quantile": "Quantile Balancing",
}
CUTOFFS = {"kplus1": "(k+1)-th biased score (SPEC default)", "exact": "exact: k-th score for experts not picked"}

# Limits on one request, so a page or a script cannot ask the server for minutes of work or gigabytes.
# The work is about 60 ns per score on a CPU core (top-k and Quantile Balancing's histogram), so
# MAX_SCORES = tokens × experts × batches keeps the largest request near a second.
MAX_TOKENS = 16_384
MAX_EXPERTS = 1024  # room for K3's own 896 routed experts (top-16)
MAX_BATCHES = 200
MAX_SCORES = 2**24
MAX_SKEW = 20.0  # beyond this sigmoid saturates: every token picks the same hot experts whatever the skew
MAX_STEP = 1.0  # u of the fixed-step rule; scores lie in (0, 1), so a larger step only overshoots further
MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed accepts


class RoutingParamError(ValueError):
    """A demo parameter out of range or of the wrong kind; `param` names it (the page marks that field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RoutingParams:
    """One demo request. The defaults are the seed's figure: 256 tokens, 16 experts, top-2, so q = 32."""

    tokens: int = 256
    experts: int = 16
    k: int = 2
    skew: float = 1.0
    seed: int = 0
    rule: str = "quantile"
    cutoff: str = "kplus1"  # Quantile Balancing's cutoff (CUTOFFS)
    step: float = 1e-3  # u of the fixed-step rule (SPEC §2.6's value by default)
    batches: int = 1

    def __post_init__(self):
        _in_range("tokens", self.tokens, 1, MAX_TOKENS, "tokens per batch")
        _in_range("experts", self.experts, 1, MAX_EXPERTS, "routed experts")
        if self.k < 1 or self.k > self.experts:
            raise RoutingParamError(
                "k", f"k = {self.k}: each token picks between 1 and E = {self.experts} experts (k ≤ experts)"
            )
        _in_range("batches", self.batches, 1, MAX_BATCHES, "batches")
        scores = self.tokens * self.experts * self.batches
        if scores > MAX_SCORES:
            raise RoutingParamError(
                "batches",
                f"tokens × experts × batches = {scores:,} scores exceeds the demo's limit of {MAX_SCORES:,}; "
                "lower one of them",
            )
        if not (math.isfinite(self.skew) and 0 <= self.skew <= MAX_SKEW):
            raise RoutingParamError("skew", f"skew = {self.skew}: must lie in [0, {MAX_SKEW:g}] (0 is unskewed)")
        if not (math.isfinite(self.step) and 0 < self.step <= MAX_STEP):
            raise RoutingParamError("step", f"step = {self.step}: the fixed-step size u must lie in (0, {MAX_STEP:g}]")
        _in_range("seed", self.seed, 0, MAX_SEED, "seed")
        if self.rule not in RULES:
            raise RoutingParamError("rule", f"rule = {self.rule!r}: one of {', '.join(RULES)}")
        if self.cutoff not in CUTOFFS:
            raise RoutingParamError("cutoff", f"cutoff = {self.cutoff!r}: one of {', '.join(CUTOFFS)}")

    @property
    def target_load(self) -> float:
        """q = m·k/E: each expert's tokens when every expert gets the same share."""
        return self.tokens * self.k / self.experts

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> "RoutingParams":
        """From a URL's query parameters (strings); absent ones take their defaults, unknown ones are refused."""
        kinds = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(query) - set(kinds))
        if unknown:
            raise RoutingParamError(unknown[0], f"unknown parameter {unknown[0]!r}; known: {', '.join(kinds)}")
        values = {}
        for name, text in query.items():
            kind = kinds[name]
            if kind in ("int", int):
                values[name] = _parse(name, text, int, "an integer")
            elif kind in ("float", float):
                values[name] = _parse(name, text, float, "a number")
            else:
                values[name] = text
        return cls(**values)


def _in_range(name: str, value: int, lo: int, hi: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RoutingParamError(name, f"{name} = {value!r}: the number of {what} is an integer")
    if not lo <= value <= hi:
        raise RoutingParamError(name, f"{name} = {value:,}: the number of {what} must lie in [{lo:,}, {hi:,}]")


def _parse(name: str, text: str, kind: type, what: str):
    try:
        return kind(text.strip())
    except ValueError:
        raise RoutingParamError(name, f"{name} = {text!r} is not {what}") from None


@dataclass
class RoutedBatch:
    """One batch: the bias it was routed with (set from the batches before it), its loads and their MaxVio."""

    bias: list[float]  # (E,) router bias during this batch
    loads: list[int]  # (E,) tokens routed to each expert; they sum to tokens · k
    maxvio: float


@dataclass
class RoutingResult:
    params: RoutingParams
    target_load: float  # q = m·k/E
    batches: list[RoutedBatch] = field(default_factory=list)
    next_bias: list[float] = field(default_factory=list)  # (E,) the bias the next batch would be routed with

    def as_dict(self) -> dict:
        return {
            "params": asdict(self.params),
            "target_load": self.target_load,
            "batches": [asdict(b) for b in self.batches],
            "next_bias": self.next_bias,
        }


def popularity_E(params: RoutingParams, gen: torch.Generator) -> torch.Tensor:
    """(E,) fp32 evenly spaced from +1 (hottest) to −1 (coldest), in a seeded order across the experts."""
    levels = torch.linspace(1.0, -1.0, params.experts) if params.experts > 1 else torch.zeros(1)
    return levels[torch.randperm(params.experts, generator=gen)]


def balancer_for(params: RoutingParams, router: Router) -> Balancer | None:
    """The rule's balancer bound to `router`, or None for plain top-k (its bias stays 0)."""
    if params.rule == "fixed":
        return FixedStepBalancer([router], u=params.step)
    if params.rule == "quantile":
        return QuantileBalancer([router], exact_cutoff=params.cutoff == "exact")
    return None


def batch_logits(params: RoutingParams) -> Iterator[torch.Tensor]:
    """The router logits of each batch in turn: (T, E) fp32, z ~ N(0, 1) + skew · popularity."""
    gen = torch.Generator().manual_seed(params.seed)
    popularity = popularity_E(params, gen)
    for _ in range(params.batches):
        yield torch.randn(params.tokens, params.experts, generator=gen) + params.skew * popularity


def identity_router(params: RoutingParams) -> Router:
    """k3's Router over E experts with input width E and an identity weight: x W^T = x, so its scores are
    sigmoid of the logits it is given."""
    router = Router(dim=params.experts, num_experts=params.experts, top_k=params.k)
    with torch.no_grad():
        router.weight.copy_(torch.eye(params.experts))
    return router


@torch.no_grad()
def route_batches(params: RoutingParams) -> RoutingResult:
    """Route `params.batches` batches in turn; after each, the rule's balancer sets the bias for the next
    (computed from one batch, applied to the next: SPEC §2.6)."""
    router = identity_router(params)
    balancer = balancer_for(params, router)
    result = RoutingResult(params, params.target_load)
    for logits_TE in batch_logits(params):
        bias = router.e_score_correction_bias.tolist()
        out = router(logits_TE)
        result.batches.append(RoutedBatch(bias, out.loads_E.tolist(), max_violation(out.loads_E)))
        if balancer is not None:
            balancer.observe([out])
            balancer.update()
    result.next_bias = router.e_score_correction_bias.tolist()
    return result


def route_query(query: Mapping[str, str]) -> tuple[int, dict]:
    """The JSON endpoint without a framework: (200, result) or (400, {"error": {"message", "param"}})."""
    try:
        params = RoutingParams.from_query(query)
    except RoutingParamError as e:
        return 400, {"error": {"message": str(e), "param": e.param}}
    return 200, route_batches(params).as_dict()


def describe_limits() -> dict:
    """The limits and choices, for the page's inputs (max attributes, the rule and cutoff menus)."""
    return {
        "max_tokens": MAX_TOKENS,
        "max_experts": MAX_EXPERTS,
        "max_batches": MAX_BATCHES,
        "max_scores": MAX_SCORES,
        "max_skew": MAX_SKEW,
        "max_step": MAX_STEP,
        "rules": RULES,
        "cutoffs": CUTOFFS,
        "defaults": asdict(RoutingParams()),
    }
