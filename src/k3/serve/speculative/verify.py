"""Verification of a draft's proposals against the big model's logits at the same positions (SPEC §3).

Greedy (temperature 0): accept the longest prefix of proposals equal to the big model's argmax, then
add the big model's own token at the first disagreement (or after the last proposal): the tokens are
exactly those greedy decoding without a draft produces.

Seeded sampling: the same rule on the exponential race (k3.serve.sampling.race). Position n's token
without a draft is argmax p_n / E_n, E_n the request's noise for n; the draft proposed argmax q_n / E_n
with the same E_n. Accepting the agreeing prefix and then the big model's own race winner gives exactly
the tokens decoding without a draft gives, so a seeded request's output does not depend on how many
proposals a step could verify (its token budget, free pages, a preemption). Each token is an exact
draw from p; a proposal is accepted with probability at least (1 − TV(p, q)) / (1 + TV(p, q)) (the
drafter-invariant coupling of Daliri et al., 2024), slightly below rejection sampling's 1 − TV.

Unseeded sampling: the rejection scheme of Leviathan et al. / Chen et al. (2023). Proposal dⱼ, drawn
from the draft's filtered distribution qⱼ, is accepted with probability min(1, pⱼ(dⱼ) / qⱼ(dⱼ)), pⱼ the
big model's filtered distribution (the request's temperature, top-k and top-p, as without a draft); at
the first rejection the token is drawn from norm(max(0, pⱼ − qⱼ)) and the step ends; if all k are
accepted a bonus token is drawn from p_k. Each emitted token then has exactly the distribution p of its
position, whatever the draft, at the highest acceptance rate a draft-dependent scheme allows.

Shape suffixes: K proposals, V vocabulary.
"""

import torch

from k3.serve.sampling import SamplingParams, position_noise, race, request_probs
from k3.serve.sequence import end_reason


def accept_greedy(best: list[int], proposals_K: list[int]) -> list[int]:
    """best: the big model's argmax at the K+1 verified positions, proposals K tokens -> the new tokens: the
    agreeing prefix of the proposals, then the big model's token where they first differ (or the bonus token)."""
    n = 0
    while n < len(proposals_K) and proposals_K[n] == best[n]:
        n += 1
    return best[: n + 1]


def accept_sampled(
    p_KV: torch.Tensor, q_KV: torch.Tensor, proposals_K: list[int], generator: torch.Generator | None
) -> list[int]:
    """p (K+1, V) the big model's distributions at the verified positions, q (K, V) the draft's that the
    proposals were drawn from -> the new tokens (accepted proposals, then a residual or bonus draw)."""
    K = len(proposals_K)
    if K:
        d = torch.tensor(proposals_K, device=p_KV.device)
        p_d = p_KV[:K].gather(1, d[:, None])[:, 0].tolist()
        q_d = q_KV.gather(1, d[:, None])[:, 0].tolist()
        u = torch.rand(K, generator=generator, device=p_KV.device, dtype=torch.float64).tolist()
    for j in range(K):
        # accept with probability min(1, p/q): u < p/q, written without dividing by q
        if u[j] * q_d[j] < p_d[j]:
            continue
        residual = (p_KV[j] - q_KV[j].to(p_KV.dtype)).clamp(min=0)
        total = residual.sum()
        # total = 0 only if p ≤ q everywhere, i.e. p = q, where rejection has probability 0; kept safe anyway
        dist = residual / total if total > 0 else p_KV[j]
        return [*proposals_K[:j], int(torch.multinomial(dist, 1, generator=generator)[0])]
    return [*proposals_K, int(torch.multinomial(p_KV[K], 1, generator=generator)[0])]


def verify(
    big_logits_KV: torch.Tensor,
    proposals_K: list[int],
    params: SamplingParams,
    position: int,
    draft_probs_KV: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    best: list[int] | None = None,
) -> list[int]:
    """One proposal row: the big model's logits (K+1, V) at its positions -> the tokens it emits, cut after
    the first one that ends the request (k3.serve.sequence.end_reason, the engine's own rule): nothing after
    it exists. position: the output position of the first of them, i.e. the request's output tokens so far
    (a seeded request's noise is keyed by it; the end rule counts from it);
    draft_probs: the draft distributions an unseeded sampled request's proposals were drawn from;
    best: the argmax of those logits when the caller took it for the whole step at once (one device read)."""
    K = len(proposals_K)
    if params.greedy:
        tokens = accept_greedy(big_logits_KV.argmax(-1).tolist() if best is None else best, proposals_K)
    elif params.coupled:
        p = request_probs(big_logits_KV[: K + 1], [params] * (K + 1), torch.float32)
        noise = position_noise(params.seed, range(position, position + K + 1), p.shape[1], p.device)
        tokens = accept_greedy(race(p, noise).tolist(), proposals_K)
    else:
        if draft_probs_KV is None or len(draft_probs_KV) < K:
            raise ValueError("sampled proposals need the draft distributions they were drawn from")
        p = request_probs(big_logits_KV[: K + 1], [params] * (K + 1))
        tokens = accept_sampled(p, draft_probs_KV[:K], proposals_K, None)
    for i, t in enumerate(tokens):
        if end_reason(params, t, position + i + 1, eos_token_id) is not None:
            return tokens[: i + 1]
    return tokens
