"""Verification keeps the big model's distribution exactly (issue 15): chi-square tests of the rejection
rule alone and of the engine with a draft, for unseeded requests (rejection sampling) and seeded ones (the
race on each position's own noise), on a tiny model with an 8-token vocabulary."""

import itertools

import pytest
import torch

from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig
from k3.serve.speculative.verify import accept_sampled
from k3.spec.draft import DraftModel
from tiny_models import tiny_model


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against probabilities (bins of expectation ≥ 5 kept; the rest
    pooled): the probability of a statistic this large if the counts were drawn from probs."""
    n = counts.sum()
    expected = probs.double() * n
    keep = expected >= 5
    obs = torch.cat([counts.double()[keep], counts.double()[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_rejection_sampling_emits_the_big_models_distribution():
    torch.manual_seed(0)
    V, K = 6, 3
    p = torch.softmax(torch.randn(K + 1, V, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(K, V, dtype=torch.float64) * 1.5, -1)
    gen = torch.Generator().manual_seed(1)
    first, second, lengths = torch.zeros(V), torch.zeros(V), []
    for _ in range(8000):
        proposals = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(K)]
        out = accept_sampled(p, q, proposals, gen)
        first[out[0]] += 1
        if out[0] == 2:  # given token 1, token 2 has distribution p[1] whatever was proposed
            second[out[1]] += 1
        lengths.append(len(out))
    assert chi_square_p_value(first, p[0]) > 1e-3
    assert chi_square_p_value(second, p[1]) > 1e-3
    assert 1 in lengths and K + 1 in lengths  # rejections and full acceptances both happened
    # the test can fail: the draft's own distribution is far from the big model's
    assert chi_square_p_value(first, q[0]) < 1e-6


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_outputs_with_speculation_follow_the_big_model(seeded):
    model = tiny_model(seed=5, vocab_size=8)
    prompt, N = [1, 2, 3, 4], 900
    # exact distributions of output tokens 2 and 3 from the model itself, summing over the earlier ones
    seqs = torch.tensor([[*prompt, a, b] for a, b in itertools.product(range(8), repeat=2)])
    with torch.no_grad():
        logits = model(seqs).logits
    p1 = torch.softmax(logits[0, len(prompt) - 1], -1)  # (8,)
    p2_given = torch.softmax(logits[::8, len(prompt)], -1)  # (8 first tokens, 8)
    p3_given = torch.softmax(logits[:, len(prompt) + 1], -1).view(8, 8, 8)  # (t1, t2, t3)
    p2 = p1 @ p2_given
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)

    draft = DraftModel(model.config, num_speculative_tokens=2).double()
    engine = LLMEngine(
        model,
        None,
        EngineConfig(
            num_pages=2000,
            enable_prefix_caching=False,
            scheduler=SchedulerConfig(max_waiting_requests=N, max_num_seqs=300, max_batched_tokens=4096),
        ),
        draft=draft,
    )
    torch.manual_seed(0)  # the unseeded requests draw from the global RNG
    for i in range(N):
        seed = i if seeded else None
        engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=3, seed=seed, ignore_eos=True))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    tokens = torch.tensor(list(outs.values()))
    assert tokens.shape == (N, 3)
    stats = engine.spec_stats
    assert 0 < stats.accepted < stats.proposed  # both accepted and rejected proposals
    for j, probs in ((1, p2), (2, p3)):
        counts = torch.bincount(tokens[:, j], minlength=8)
        assert chi_square_p_value(counts, probs) > 1e-3, (j, counts, probs * N)
