"""The model over the page pool: chunked prefill and batched decode of sequences of different lengths
give the logits of one uncached forward per sequence."""

import dataclasses

import pytest
import torch

from k3.serve.layout import PageLayout
from k3.serve.model_runner import ModelRunner
from k3.serve.plan import StepPlan, decode_row, prefill_piece
from k3.serve.pool import PagePool
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import Scheduler, SchedulerConfig
from k3.serve.sequence import Sequence
from tiny_models import tiny_model


def new_seq(pool: PagePool, prompt: list[int]) -> Sequence:
    seq = Sequence(f"s{len(prompt)}", prompt, SamplingParams(max_tokens=100))
    seq.state_pages = pool.allocate(pool.layout.n_kda)
    return seq


def grow(pool: PagePool, seq: Sequence, tokens: int) -> None:
    """Give seq enough latent pages for `tokens` tokens (what the scheduler does)."""
    need = pool.layout.latent_pages(tokens) - len(seq.latent_pages)
    if need > 0:
        seq.latent_pages += pool.allocate(need)


def run(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    """Execute a plan made by hand and advance progress as the engine does (Scheduler.complete)."""
    logits = runner.run(plan)
    Scheduler(SchedulerConfig(), runner.pool).complete(plan)
    return logits


def test_chunked_prefill_and_batched_decode_match_uncached():
    """The runner takes the model's configured MLA path (naive here) over the paged cache; the
    reference is the uncached forward."""
    model = tiny_model(mla_impl="naive")
    layout = PageLayout.from_config(model.config, torch.float64)
    pool = PagePool(layout, num_pages=200)
    runner = ModelRunner(model, pool)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    seqs = [new_seq(pool, p) for p in prompts]
    pool.kda_states()[:] = 7.0  # stale data from earlier requests must not leak into new ones

    def reference(seq: Sequence) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([seq.all_token_ids])).logits[0, -1]

    for seq in seqs:  # prefill in uneven chunks; only the last one is sampled
        pos = 0
        while pos < seq.num_tokens:
            n = min(seq.num_tokens - pos, 9)
            grow(pool, seq, pos + n)
            logits = run(runner, StepPlan([prefill_piece(seq, pos, pos + n)]))
            assert len(logits) == (pos + n == seq.num_tokens)
            pos += n
        assert torch.allclose(logits[0], reference(seq), atol=1e-9)
        seq.append_token(int(logits[0].argmax()))

    for _ in range(12):  # decode all three together
        for seq in seqs:
            grow(pool, seq, seq.num_tokens)
        logits = run(runner, StepPlan(decode=[decode_row(s) for s in seqs]))
        for seq, row in zip(seqs, logits, strict=True):
            assert torch.allclose(row, reference(seq), atol=1e-9)
            seq.append_token(int(row.argmax()))


@pytest.mark.parametrize("impl", ["auto", "absorbed", "naive"])
def test_one_forward_mixes_prefill_chunks_and_decodes(impl):
    """Each step packs prefill chunks of random (often equal) lengths and the decodes of sequences
    whose prompt is done into one forward; every returned row equals that sequence's uncached logits
    (every piece is marked sampled here, so that each returns its logits)."""
    model = tiny_model(mla_impl=impl)
    layout = PageLayout.from_config(model.config, torch.float64)
    pool = PagePool(layout, num_pages=300)
    runner = ModelRunner(model, pool)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 6, 13, 13, 30, 70)]
    prompt_len = [len(p) for p in prompts]
    seqs = [new_seq(pool, p) for p in prompts]
    checked = {"prefill": 0, "decode": 0}
    while any(s.num_tokens < n + 6 for s, n in zip(seqs, prompt_len, strict=True)):
        plan = StepPlan()
        for seq, n in zip(seqs, prompt_len, strict=True):
            start = seq.num_computed_tokens
            if start < n:
                chunk = min(n - start, (4, 8, 12, 64)[int(torch.randint(0, 4, (1,), generator=gen))])
                grow(pool, seq, start + chunk)
                plan.prefill.append(dataclasses.replace(prefill_piece(seq, start, start + chunk), sample=True))
            elif seq.num_tokens < n + 6:
                grow(pool, seq, seq.num_tokens)
                plan.decode.append(decode_row(seq))
        logits = run(runner, plan)
        assert logits.shape == (len(plan.pieces), 512)
        for piece, row in zip(plan.pieces, logits, strict=True):
            seq = piece.seq
            with torch.no_grad():
                ref = model(torch.tensor([seq.all_token_ids[: seq.num_computed_tokens]])).logits[0, -1]
            assert (row - ref).abs().max() < 1e-9
            checked["decode" if seq.num_tokens > prompt_len[seqs.index(seq)] else "prefill"] += 1
            if seq.num_computed_tokens == seq.num_tokens:  # prompt done or decoded: take the next token
                seq.append_token(int(row.argmax()))
    assert checked["decode"] >= 6 * 5 and checked["prefill"] >= 6


def test_pieces_of_one_sequence_in_one_forward_and_checkpoints():
    """A prompt split into pieces (two of equal length) computed in one forward, the KDA state after
    each of the first two filled into checkpoint pages on the way: every piece's last logits equal the
    uncached forward, and each checkpoint equals the state after that many tokens computed alone."""
    model = tiny_model()
    layout = PageLayout.from_config(model.config, torch.float64)
    pool = PagePool(layout, num_pages=100)
    runner = ModelRunner(model, pool)
    prompt = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(5)).tolist()
    one, ref = new_seq(pool, list(prompt)), new_seq(pool, list(prompt))
    grow(pool, one, 50)
    first = one.latent_pages[0]
    assert one.latent_pages == list(range(first, first + len(one.latent_pages)))  # one run: read in place
    checkpoints = [pool.allocate(layout.n_kda) for _ in range(2)]
    plan = StepPlan(
        [
            dataclasses.replace(prefill_piece(one, 0, 10, 0, checkpoints[0]), sample=True),
            dataclasses.replace(prefill_piece(one, 10, 20, 1, checkpoints[1]), sample=True),
            prefill_piece(one, 20, 50, 2),
        ]
    )
    logits = run(runner, plan)
    assert one.num_computed_tokens == 50
    for row, end in zip(logits, (10, 20, 50), strict=True):
        with torch.no_grad():
            assert (row - model(torch.tensor([prompt[:end]])).logits[0, -1]).abs().max() < 1e-9
    for pages, end in zip(checkpoints, (10, 20), strict=True):
        grow(pool, ref, end)
        run(runner, StepPlan([prefill_piece(ref, ref.num_computed_tokens, end)]))
        for view in (pool.kda_states(), pool.kda_conv()):
            assert (view[pages] - view[ref.state_pages]).abs().max() < 1e-10  # not bitwise: other matmul shapes
