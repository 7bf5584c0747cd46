"""Speculative decoding in the engine (issue 15): greedy tokens identical with and without speculation for
mixed batches, KDA rollback bitwise equal to never having seen the rejected tokens, rejected tokens'
pages released, prefix-cache counters unchanged by speculation."""

import random

import pytest
import torch

from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.model_runner import ModelRunner
from k3.serve.plan import ProposalRow, StepPlan, prefill_piece
from k3.serve.sampling import SamplingParams
from k3.serve.sequence import Sequence
from k3.serve.speculative.proposer import Proposer
from k3.serve.speculative.verify import verify
from k3.spec.draft import DraftModel
from tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=18)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


class OracleProposer(Proposer):
    """Proposes the true greedy continuation with some tokens corrupted, so that verification accepts
    every count from 0 to k; knows the reference outputs by prompt."""

    def __init__(self, draft, reference: dict[tuple, list[int]], seed: int = 0):
        super().__init__(draft)
        self.reference, self.rng = reference, random.Random(seed)

    def propose(self, seqs, summaries):
        for seq in seqs:
            k = self.room(seq)
            truth = self.reference[tuple(seq.prompt_token_ids)][seq.num_output_tokens : seq.num_output_tokens + k]
            bad = self.rng.randrange(len(truth) + 1) if truth else 0
            seq.draft_token_ids = [t if j != bad else (t + 1) % 500 for j, t in enumerate(truth)]
            seq.draft_probs = None


def run(model, prompts, params, draft=None, oracle=None, steps_between=1, **config):
    """Generate for every prompt, adding one prompt every `steps_between` steps (so prefills, decodes and
    verify rows mix); returns the outputs in prompt order and the engine."""
    engine = LLMEngine(model, None, EngineConfig(num_pages=config.pop("num_pages", 400), **config), draft=draft)
    if oracle is not None:
        engine.proposer = OracleProposer(draft.attach(model), oracle)
    out, ids, pending = {}, [], list(prompts)
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % steps_between == 0:
            ids.append(engine.add_request(pending.pop(0), params))
            out[ids[-1]] = []
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        step += 1
    engine.pool.check()
    assert engine.pool.num_used == 0
    return [out[i] for i in ids], engine


PROMPTS = [list(range(1, 40)), [5, 6, 7], list(range(40, 110)), [9] * 20, list(range(200, 223))]


@pytest.mark.parametrize("rollback", ["replay", "snapshot"])
def test_greedy_tokens_equal_with_and_without_speculation(model, rollback):
    ref, _ = run(model, PROMPTS, GREEDY)
    oracle = {tuple(p): r for p, r in zip(PROMPTS, ref, strict=True)}
    draft = DraftModel(model.config).double()
    got, engine = run(model, PROMPTS, GREEDY, draft, oracle, spec_rollback=rollback)
    assert got == ref
    stats = engine.spec_stats
    # every acceptance count happened, so every rollback length was exercised
    assert stats.accepted > 0 and 0 < stats.accepted < stats.proposed
    assert len({a for a in stats.accepted_at}) > 1
    # a real (untrained) draft in both modes, with max_tokens leaving less room than k at the end
    for mode in ("chain", "block"):
        got, _ = run(
            model,
            PROMPTS,
            GREEDY,
            DraftModel(model.config, mode=mode).double(),
            spec_rollback=rollback,
            steps_between=2,
        )
        assert got == ref


def _rolled_back(model, mode: str, prompt: list[int], tokens: list[int], n: int) -> torch.Tensor:
    """The KDA state pages (S and conv tails) after a verify row (7, *tokens) kept n of its tokens."""
    engine = LLMEngine(model, None, EngineConfig(num_pages=60, enable_prefix_caching=False))
    runner = ModelRunner(model, engine.pool, mode)
    seq = Sequence("r", [*prompt, 7], GREEDY)
    seq.state_pages = engine.pool.allocate(engine.layout.n_kda)
    seq.latent_pages = engine.pool.allocate(engine.layout.latent_pages(len(prompt) + 8))
    runner.run(StepPlan([prefill_piece(seq, 0, len(prompt))]))
    row = ProposalRow(seq, len(prompt), (7, *tokens), tuple(seq.latent_pages), tuple(seq.state_pages))
    out = runner.execute(StepPlan(decode=[row]))
    runner.rollback(out, {seq: n})
    return engine.pool.storage[seq.state_pages].clone()


def test_rollback_is_bitwise_equal_to_never_seeing_the_rejected_tokens():
    """Snapshot rollback: the state kept after n tokens does not depend, to the last bit, on what the
    rejected tokens were; both modes equal a verify row given only the n tokens (to fp64 rounding: a
    forward over more rows rounds differently in the matmuls, and the chunked form of "replay" scales
    a chunk by a pivot taken over all its tokens). Dense FFNs: a MoE's per-expert matmuls see the whole
    batch, rejected tokens included, which is batch dependence of the forward, not of the rollback."""
    model = tiny_model(seed=3, first_k_dense_replace=5)
    prompt, proposals = list(range(3, 33)), [11, 12, 13, 14, 15, 16]
    for n in (1, 2, 4, 7):
        never_seen = _rolled_back(model, "snapshot", prompt, proposals[: n - 1], n)
        kept = _rolled_back(model, "snapshot", prompt, proposals, n)
        for tail in ([99] * (7 - n), [n + 1] * (7 - n)):
            assert torch.equal(_rolled_back(model, "snapshot", prompt, proposals[: n - 1] + tail, n), kept), n
        torch.testing.assert_close(kept, never_seen, rtol=0, atol=1e-13)
        torch.testing.assert_close(_rolled_back(model, "replay", prompt, proposals, n), never_seen, rtol=0, atol=1e-13)
        if n == 7:  # nothing rejected: nothing to roll back
            assert torch.equal(kept, never_seen)
    # the states did move: a rollback to n differs from one to n + 1
    assert not torch.allclose(
        _rolled_back(model, "snapshot", prompt, proposals, 2), _rolled_back(model, "snapshot", prompt, proposals, 3)
    )


def test_rejected_tokens_pages_are_released(model):
    draft = DraftModel(model.config).double()
    engine = LLMEngine(model, None, EngineConfig(num_pages=400, enable_prefix_caching=False), draft=draft)
    P = engine.layout.page_tokens
    engine.add_request(list(range(1, P - 1)), SamplingParams(temperature=0, max_tokens=3 * P))
    engine.step()  # prefill; the draft proposes 7, whose slots cross into a second page
    seq = next(iter(engine.seqs.values()))
    assert len(seq.draft_token_ids) == 7
    engine.step()  # verify: an untrained draft's proposals are rejected
    assert engine.spec_stats.accepted == 0
    assert len(seq.latent_pages) == engine.layout.latent_pages(seq.num_computed_tokens + 1) == 1


def test_prefix_cache_hits_equal_with_and_without_speculation(model):
    shared = list(range(1, 60))
    prompts = [shared + [70 + i] * (i + 1) for i in range(4)] + [shared]
    kw = dict(hash_block_pages=1, checkpoint_interval_units=1)
    ref, plain = run(model, prompts, GREEDY, steps_between=6, **kw)
    oracle = {tuple(p): r for p, r in zip(prompts, ref, strict=True)}
    got, spec = run(model, prompts, GREEDY, DraftModel(model.config).double(), oracle, steps_between=6, **kw)
    assert got == ref
    assert plain.cache.stats.state_hit_tokens > 0 and plain.cache.stats.checkpoints_stored > 0
    assert spec.cache.stats.as_dict() == plain.cache.stats.as_dict()


def test_a_stop_token_inside_the_accepted_tokens_ends_the_output_there(model):
    ref, _ = run(model, PROMPTS, GREEDY)
    stop = SamplingParams(temperature=0, max_tokens=18, stop_token_ids=(ref[0][5], ref[2][3]))
    ref_stop, _ = run(model, PROMPTS, stop)
    assert len(ref_stop[0]) == 6
    oracle = {tuple(p): r for p, r in zip(PROMPTS, ref, strict=True)}
    got, engine = run(model, PROMPTS, stop, DraftModel(model.config).double(), oracle)
    assert got == ref_stop and engine.spec_stats.accepted > 0


def test_speculation_only_at_small_batches_when_asked(model):
    """spec_max_batch = 1: proposals only while one request runs; the tokens are the same either way."""
    ref, _ = run(model, PROMPTS[:3], GREEDY)
    oracle = {tuple(p): r for p, r in zip(PROMPTS[:3], ref, strict=True)}
    got, engine = run(
        model, PROMPTS[:3], GREEDY, DraftModel(model.config).double(), oracle, steps_between=2, spec_max_batch=1
    )
    assert got == ref
    everywhere = run(model, PROMPTS[:3], GREEDY, DraftModel(model.config).double(), oracle, steps_between=2)[1]
    assert 0 < engine.spec_stats.verify_steps < everywhere.spec_stats.verify_steps


def test_verification_cuts_where_the_end_rule_ends_the_request():
    """verify keeps the tokens up to the first that ends the request by the engine's own rule: a stop token,
    or the max_tokens-th output token (position counts the output tokens before the row)."""
    logits = torch.full((4, 10), -10.0)
    logits[torch.arange(4), torch.tensor([3, 4, 5, 6])] = 0.0  # the big model's tokens: 3 4 5 6
    greedy = SamplingParams(temperature=0, max_tokens=5)
    assert verify(logits, [3, 4, 5], greedy, position=0) == [3, 4, 5, 6]
    assert verify(logits, [3, 4, 5], greedy, position=3) == [3, 4]  # the 5th output token ends it
    stopping = SamplingParams(temperature=0, max_tokens=100, stop_token_ids=[4])
    assert verify(logits, [3, 4, 5], stopping, position=0) == [3, 4]


def test_proposals_are_bounded_by_the_tokens_the_request_may_still_produce(model):
    proposer = Proposer(DraftModel(model.config, num_speculative_tokens=7).double().attach(model))
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5))
    seq.output_token_ids = [4, 5]
    assert seq.tokens_left == 3 and proposer.room(seq) == 2  # the bonus token is the third
    seq.output_token_ids = [4, 5, 6, 7]
    assert proposer.room(seq) == 0
