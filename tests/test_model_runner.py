"""The model over the page pool: chunked prefill and batched decode of sequences of different lengths
give the logits of one uncached forward per sequence."""

from dataclasses import dataclass, field

import pytest
import torch

from k3.serve.model_runner import ModelRunner
from k3.serve.pool import PageLayout, PagePool
from tiny_models import tiny_model


@dataclass
class Seq:
    """The fields of k3.serve.sequence.Sequence that the runner reads."""

    all_token_ids: list[int]
    num_computed_tokens: int = 0
    latent_pages: list[int] = field(default_factory=list)
    state_pages: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]


def grow(pool: PagePool, seq: Seq, tokens: int) -> None:
    """Give seq enough latent pages for `tokens` tokens (what the scheduler does)."""
    need = pool.layout.latent_pages(tokens) - len(seq.latent_pages)
    if need > 0:
        seq.latent_pages += pool.allocate(need)


def test_chunked_prefill_and_batched_decode_match_uncached():
    """The runner takes the model's configured MLA path (naive here) over the paged cache; the
    reference is the uncached forward."""
    model = tiny_model(mla_impl="naive")
    layout = PageLayout.from_config(model.config, torch.float64)
    pool = PagePool(layout, num_pages=200)
    runner = ModelRunner(model, pool)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    seqs = [Seq(p, state_pages=pool.allocate(layout.n_kda)) for p in prompts]
    pool.kda_states()[:] = 7.0  # stale data from earlier requests must not leak into new ones

    def reference(seq: Seq) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([seq.all_token_ids])).logits[0, -1]

    for seq in seqs:  # prefill in uneven chunks
        pos = 0
        while pos < seq.num_tokens:
            n = min(seq.num_tokens - pos, 9)
            grow(pool, seq, pos + n)
            logits = runner.prefill(seq, n)
            pos += n
        assert torch.allclose(logits, reference(seq), atol=1e-9)
        seq.all_token_ids.append(int(logits.argmax()))

    for _ in range(12):  # decode all three together
        for seq in seqs:
            grow(pool, seq, seq.num_tokens)
        logits = runner.decode(seqs)
        for seq, row in zip(seqs, logits, strict=True):
            assert torch.allclose(row, reference(seq), atol=1e-9)
            seq.all_token_ids.append(int(row.argmax()))


@pytest.mark.parametrize("impl", ["auto", "absorbed", "naive"])
def test_one_forward_mixes_prefill_chunks_and_decodes(impl):
    """Each step packs prefill chunks of random (often equal) lengths and the decodes of sequences
    whose prompt is done into one forward; every returned row equals that sequence's uncached logits."""
    model = tiny_model(mla_impl=impl)
    layout = PageLayout.from_config(model.config, torch.float64)
    pool = PagePool(layout, num_pages=300)
    runner = ModelRunner(model, pool)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 6, 13, 13, 30, 70)]
    prompt_len = [len(p) for p in prompts]
    seqs = [Seq(p, state_pages=pool.allocate(layout.n_kda)) for p in prompts]
    checked = {"prefill": 0, "decode": 0}
    while any(s.num_tokens < n + 6 for s, n in zip(seqs, prompt_len, strict=True)):
        prefill, decode = [], []
        for seq, n in zip(seqs, prompt_len, strict=True):
            if seq.num_computed_tokens < n:
                chunk = min(n - seq.num_computed_tokens, (4, 8, 12, 64)[int(torch.randint(0, 4, (1,), generator=gen))])
                grow(pool, seq, seq.num_computed_tokens + chunk)
                prefill.append((seq, chunk))
            elif seq.num_tokens < n + 6:
                grow(pool, seq, seq.num_tokens)
                decode.append(seq)
        logits = runner.run(prefill, decode)
        assert logits.shape == (len(prefill) + len(decode), 512)
        for (seq, _), row in zip(prefill + [(s, 1) for s in decode], logits, strict=True):
            with torch.no_grad():
                ref = model(torch.tensor([seq.all_token_ids[: seq.num_computed_tokens]])).logits[0, -1]
            assert (row - ref).abs().max() < 1e-9
            checked["decode" if seq.num_tokens > prompt_len[seqs.index(seq)] else "prefill"] += 1
            if seq.num_computed_tokens == seq.num_tokens:  # prompt done or decoded: take the next token
                seq.all_token_ids.append(int(row.argmax()))
    assert checked["decode"] >= 6 * 5 and checked["prefill"] >= 6


def test_pieces_of_one_sequence_in_one_forward_and_snapshots():
    """A prompt split into pieces (two of equal length) computed in one forward, the KDA state after
    each of the first two written into snapshot pages on the way: every piece's last logits equal the
    uncached forward, and each snapshot equals the state after that many tokens computed alone."""
    model = tiny_model()
    layout = PageLayout.from_config(model.config, torch.float64)
    pool = PagePool(layout, num_pages=100)
    runner = ModelRunner(model, pool)
    prompt = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(5)).tolist()
    one, ref = (Seq(list(prompt), state_pages=pool.allocate(layout.n_kda)) for _ in range(2))
    grow(pool, one, 50)
    first = one.latent_pages[0]
    assert one.latent_pages == list(range(first, first + len(one.latent_pages)))  # one run: read in place
    snaps = [pool.allocate(layout.n_kda) for _ in range(2)]
    logits = runner.run([(one, 10, snaps[0]), (one, 10, snaps[1]), (one, 30)], [])
    assert one.num_computed_tokens == 50
    for row, end in zip(logits, (10, 20, 50), strict=True):
        with torch.no_grad():
            assert (row - model(torch.tensor([prompt[:end]])).logits[0, -1]).abs().max() < 1e-9
    for pages, n in zip(snaps, (10, 10), strict=True):
        grow(pool, ref, ref.num_computed_tokens + n)
        runner.run([(ref, n)], [])
        for view in (pool.kda_states(), pool.kda_conv()):
            assert (view[pages] - view[ref.state_pages]).abs().max() < 1e-10  # not bitwise: other matmul shapes
