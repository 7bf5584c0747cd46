"""The step plan: what the scheduler decides is what the runner computes, and a KDA checkpoint the plan
reserves is filled with the state exactly at its position."""

import math

import pytest
import torch

from k3 import K3Config
from k3.formats.tokenizer import byte_tokenizer
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.layout import PageLayout
from k3.serve.model_runner import ModelRunner
from k3.serve.plan import DecodeRow, StepPlan, prefill_piece
from k3.serve.pool import PagePool
from k3.serve.prefix_cache import PrefixCache
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import Scheduler, SchedulerConfig
from k3.serve.sequence import Sequence
from tiny_models import tiny_model

LAYOUT = PageLayout.from_config(K3Config.from_preset("tiny", qk_rope_head_dim=9))  # 16 tokens a page
TOK = byte_tokenizer()


def test_the_plan_of_a_mixed_step_is_what_the_scheduler_promised():
    """A decode and a prefill split at a checkpoint position in one step: typed pieces with the tokens,
    page tables and reserved checkpoint pages; nothing advances until complete()."""
    pool = PagePool(LAYOUT, 64)
    cache = PrefixCache(pool, 16, checkpoint_interval_tokens=32)
    sched = Scheduler(SchedulerConfig(max_batched_tokens=60), pool, cache)
    a = Sequence("A", list(range(1, 11)), SamplingParams(max_tokens=8))
    sched.add(a)
    sched.complete(sched.schedule())  # A's prompt, below one unit (no model: only the bookkeeping is checked)
    a.append_token(7)
    b = Sequence("B", list(range(100, 170)), SamplingParams(max_tokens=8))
    sched.add(b)

    plan = sched.schedule()
    assert plan.decode == [DecodeRow(a, 10, (7,), tuple(a.latent_pages), tuple(a.state_pages))]
    assert [(p.seq, p.start, p.end, p.phase, p.sample) for p in plan.prefill] == [
        (b, 0, 32, 0, False),
        (b, 32, 59, 1, False),
    ]  # 59 = the 60-token budget less A's decode; split at the checkpoint at 32
    assert [p.token_ids for p in plan.prefill] == [tuple(range(100, 132)), tuple(range(132, 159))]
    assert all(p.latent_pages == tuple(b.latent_pages) and p.state_pages == tuple(b.state_pages) for p in plan.prefill)
    assert len(b.latent_pages) == math.ceil(59 / 16) and len(b.state_pages) == LAYOUT.n_kda
    reserved = plan.prefill[0].checkpoint_pages
    assert plan.prefill[1].checkpoint_pages is None and plan.checkpoint_pages == list(reserved)
    assert len(reserved) == LAYOUT.n_kda and all(pool.refcount(p) == 1 and pool.key(p) is None for p in reserved)
    assert plan.num_tokens == 60 and plan.sampled == plan.decode
    assert (a.num_computed_tokens, b.num_computed_tokens, cache.num_checkpoints) == (10, 0, 0)

    sched.complete(plan)
    assert (a.num_computed_tokens, b.num_computed_tokens, cache.num_checkpoints) == (11, 59, 1)
    assert [pool.key(p) for p in reserved] == [("checkpoint", pool.key(reserved[0])[1], i) for i in range(3)]
    assert all(pool.refcount(p) == 0 for p in reserved)  # cached and evictable, held by no request

    a.append_token(8)
    plan = sched.schedule()  # B's last piece ends at its last prompt token: sampled, after the checkpoint at 64
    assert [(p.start, p.end, p.phase, p.sample, p.checkpoint_pages is not None) for p in plan.prefill] == [
        (59, 64, 0, False, True),
        (64, 70, 1, True, False),
    ]
    assert plan.sampled == [plan.prefill[1], *plan.decode]
    sched.abandon(plan)  # a failed forward: the reserved pages come back, progress stays
    held = a.latent_pages + a.state_pages + b.latent_pages + b.state_pages
    assert b.num_computed_tokens == 59 and pool.num_used == len(held)  # no checkpoint page is held
    pool.check()


def test_a_piece_outside_its_sequence_is_refused():
    seq = Sequence("s", [1, 2, 3])
    for start, end in ((0, 4), (2, 2), (-1, 1)):
        with pytest.raises(ValueError, match="a piece needs 0 <= start < end <= 3"):
            prefill_piece(seq, start, end)


def test_checkpoints_hold_the_state_exactly_at_their_positions():
    """The engine prefills a 150-token prompt 50 tokens a step, so its pieces cross the checkpoint positions
    (68 and 136 with 17-token pages) inside steps; each cached checkpoint equals the KDA state and conv
    tails after exactly that many tokens computed alone, and differs from one token before or after."""
    model = tiny_model(vocab_size=TOK.vocab_size)
    eng = LLMEngine(model, TOK, EngineConfig(num_pages=200, scheduler=SchedulerConfig(max_batched_tokens=50)))
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=2))
    while eng.has_unfinished():
        eng.step()
    assert eng.cache.checkpoint_positions(150) == [68, 136] and eng.cache.num_checkpoints == 2

    def state_after(n: int) -> torch.Tensor:
        pool = PagePool(eng.layout, 40)
        seq = Sequence("ref", prompt[:n])
        seq.state_pages, seq.latent_pages = pool.allocate(eng.layout.n_kda), pool.allocate(eng.layout.latent_pages(n))
        ModelRunner(model, pool).run(StepPlan([prefill_piece(seq, 0, n)]))
        return torch.cat([pool.kda_states()[seq.state_pages].flatten(), pool.kda_conv()[seq.state_pages].flatten()])

    for position in (68, 136):
        match = eng.cache.match([*prompt[:position], 1])
        assert match.resume_tokens == position
        pages = match.checkpoint_pages
        stored = torch.cat([eng.pool.kda_states()[pages].flatten(), eng.pool.kda_conv()[pages].flatten()])
        assert (stored - state_after(position)).abs().max() < 1e-10
        for other in (position - 1, position + 1):
            assert (stored - state_after(other)).abs().max() > 1e-6
