"""The lean decode step: KDA states updated where they lie in the pool (a strided view when the rows are
in arithmetic progression, row indices otherwise), a one-token piece's checkpoint filled on the way."""

import dataclasses

import pytest
import torch
from torch import nn

from k3.model.attn_res import AttnResStream, attn_res
from k3.model.norm import RMSNorm
from k3.serve.layout import PageLayout
from k3.serve.model_runner import ModelRunner
from k3.serve.paged_cache import _progression
from k3.serve.plan import StepPlan, decode_row, prefill_piece
from k3.serve.pool import PagePool
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import Scheduler, SchedulerConfig
from k3.serve.sequence import Sequence
from tiny_models import tiny_model


def test_progression():
    assert _progression([7]) == (7, 1)
    assert _progression([3, 8, 13]) == (3, 5)
    assert _progression([3, 8, 12]) is None
    assert _progression([8, 3]) is None  # a negative step is not a forward slice
    assert _progression([4, 4]) is None


@pytest.mark.parametrize("layout_kind", ["progression", "scattered"])
def test_decode_updates_pool_rows_in_place_and_fills_a_one_token_checkpoint(layout_kind):
    """Three sequences decode together with their state pages in arithmetic progression or not; a fourth
    runs a one-token prefill piece in the same group that ends at a checkpoint. Every logit row equals
    the uncached forward, the checkpoint equals the fourth's state, and no other page changes."""
    model = tiny_model()
    layout = PageLayout.from_config(model.config, torch.float64)
    pool = PagePool(layout, num_pages=200)
    runner = ModelRunner(model, pool)
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for i, n in enumerate((5, 9, 14, 1)):
        seq = Sequence(f"s{i}", torch.randint(0, 512, (n,), generator=gen).tolist(), SamplingParams(max_tokens=9))
        seq.state_pages = pool.allocate(layout.n_kda)
        if layout_kind == "scattered":
            pool.allocate(i + 1)  # uneven gaps: no common stride between the sequences' rows
        seqs.append(seq)
    decoders, single = seqs[:3], seqs[3]
    for seq in decoders:
        seq.latent_pages = pool.allocate(layout.latent_pages(seq.num_tokens + 4))
        runner.run(StepPlan([prefill_piece(seq, 0, seq.num_tokens)]))
        Scheduler(SchedulerConfig(), pool).complete(StepPlan([prefill_piece(seq, 0, seq.num_tokens)]))
        seq.append_token(3)
    rows = [[s.state_pages[j] for s in decoders] for j in range(layout.n_kda)]
    assert all((_progression(r) is not None) == (layout_kind == "progression") for r in rows)
    single.latent_pages = pool.allocate(1)
    checkpoint = pool.allocate(layout.n_kda)
    piece = dataclasses.replace(prefill_piece(single, 0, 1, 0, checkpoint), sample=True)
    plan = StepPlan([piece], [decode_row(s) for s in decoders])
    touched = {p for s in seqs for p in s.state_pages + s.latent_pages} | set(checkpoint)
    before = pool.storage.clone()
    logits = runner.run(plan)
    Scheduler(SchedulerConfig(), pool).complete(plan)
    for seq, row in zip([single, *decoders], logits, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([seq.all_token_ids])).logits[0, -1]
        assert (row - ref).abs().max() < 1e-9
    for view in (pool.kda_states(), pool.kda_conv()):
        assert torch.equal(view[list(checkpoint)], view[list(single.state_pages)])
    untouched = [p for p in range(pool.num_pages) if p not in touched]
    assert torch.equal(pool.storage[untouched], before[untouched])


def test_inference_attn_res_is_the_training_form_bitwise():
    """AttnResStream at inference (each completed block's 1/rms computed once) gives bitwise attn_res over
    the same sources as training computes it, with and without a partial sum, as blocks complete."""
    torch.manual_seed(0)
    d = 16
    proj, norm = nn.Linear(d, 1, bias=False).double(), RMSNorm(d).double()
    with torch.no_grad():
        proj.weight.normal_()
        norm.weight.uniform_(0.5, 1.5)
    stream = AttnResStream(torch.randn(2, 3, d, dtype=torch.float64), block_starts={1, 2})
    for layer in range(4):
        stream.begin_layer(layer)
        for _ in range(2):
            sources = stream.blocks if stream.partial is None else [*stream.blocks, stream.partial]
            with torch.no_grad():
                got = stream.input((proj, norm))
            want = attn_res(sources, proj, norm)  # the query requires grad: the training Function's forward
            assert len(stream._inv_rms) == (len(stream.blocks) if len(sources) > 1 else 0)  # the cache ran
            assert torch.equal(got, want.detach())
            stream.add(torch.randn(2, 3, d, dtype=torch.float64))
    assert len(stream.blocks) == 3


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_derived_weights_follow_their_parameters():
    """The concatenated weights kept across inference calls are rebuilt after an in-place change, after
    load_state_dict, and after a parameter is replaced; under autograd they are built fresh, so gradients
    reach every projection."""
    model, ids = tiny_model(), torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(0))
    _logits(model, ids)  # the caches are built
    kda = next(layer.self_attn for layer in model.model.layers if layer.kind == "kda")
    fresh = tiny_model(seed=1)
    with torch.no_grad():
        kda.q_proj.weight.mul_(3.0)  # in place
        kda.q_conv1d.weight.add_(0.5)
    ref = tiny_model()
    with torch.no_grad():
        ref_kda = next(layer.self_attn for layer in ref.model.layers if layer.kind == "kda")
        ref_kda.q_proj.weight.mul_(3.0)
        ref_kda.q_conv1d.weight.add_(0.5)
    # ref's caches are built after its change: equal logits mean model's were rebuilt
    assert torch.allclose(_logits(model, ids), _logits(ref, ids), atol=1e-12)
    model.load_state_dict(fresh.state_dict())
    assert torch.allclose(_logits(model, ids), _logits(fresh, ids), atol=1e-12)
    kda.b_proj.weight = nn.Parameter(kda.b_proj.weight.detach() * -1.0)
    fresh_kda = next(layer.self_attn for layer in fresh.model.layers if layer.kind == "kda")
    with torch.no_grad():
        fresh_kda.b_proj.weight.mul_(-1.0)
    assert torch.allclose(_logits(model, ids), _logits(fresh, ids), atol=1e-12)
    model(ids).logits.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in kda._input_weights())
