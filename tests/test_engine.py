"""The engine end to end on the tiny model: batching, prefix caching, admission, preemption, aborts."""

import random

import pytest
import torch

from k3 import K3Model, generate
from k3.formats.tokenizer import byte_tokenizer
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import Overloaded, SchedulerConfig
from tiny_models import tiny_model

TOK = byte_tokenizer()


@pytest.fixture(scope="module")
def model() -> K3Model:
    return tiny_model(vocab_size=TOK.vocab_size)


def engine(model, num_pages=400, caching=True, **sched) -> LLMEngine:
    return LLMEngine(
        model, TOK, EngineConfig(num_pages=num_pages, enable_prefix_caching=caching, scheduler=SchedulerConfig(**sched))
    )


def run(eng: LLMEngine, prompts, params) -> dict[str, list[int]]:
    ids = [eng.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    for _ in range(10_000):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    return generate(model, torch.tensor([prompt]), n, temperature=0)[0, len(prompt) :].tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts_with_shared_prefix(seed=0, n=6):
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(70)]  # 4.1 units of 17 tokens: ends mid-unit
    return [system + [rng.randrange(256) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def test_batched_engine_equals_one_at_a_time_generation(model):
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
    out = run(engine(model, caching=False, max_batched_tokens=24), prompts, GREEDY)
    assert out == [greedy_reference(model, p, 6) for p in prompts]


def test_prefix_caching_gives_identical_tokens_and_hits(model):
    prompts = prompts_with_shared_prefix()
    plain = run(engine(model, caching=False), prompts, GREEDY)
    eng = engine(model, caching=True, max_batched_tokens=32)
    run(eng, prompts[:1], GREEDY)  # warm the cache with the shared system prompt
    cached = run(eng, prompts[1:], GREEDY)
    assert cached == plain[1:]
    m = eng.metrics()
    assert m["state_hit_tokens"] >= 5 * 64 and m["latent_hit_tokens"] >= m["state_hit_tokens"]


def test_eviction_under_pressure_keeps_results_exact(model):
    prompts = prompts_with_shared_prefix(seed=1, n=8)
    plain = run(engine(model, caching=False), prompts, GREEDY)
    layout_pages = 3 + 8  # one request: 3 KDA state pages + latents of ~100 prompt + 6 output tokens
    eng = engine(model, num_pages=3 * layout_pages, caching=True, max_batched_tokens=16)
    assert run(eng, prompts, GREEDY) == plain
    assert eng.metrics()["evicted_units"] + eng.metrics()["evicted_checkpoints"] > 0
    eng.pool.check()


def test_preemption_by_recompute_keeps_results_exact(model):
    prompts = [list(range(1, 1 + n)) for n in (30, 31, 32, 33)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [greedy_reference(model, p, 40) for p in prompts]
    eng = engine(model, num_pages=2 * (3 + 5), caching=False, reserve_output_fraction=0.0)
    assert run(eng, prompts, params) == plain
    assert eng.metrics()["preemptions"] > 0
    assert eng.pool.num_used == 0


def test_admission_errors(model):
    eng = engine(model, num_pages=20, caching=False, max_waiting_requests=2)
    with pytest.raises(ValueError, match=r"needs .* pages .* but the pool has 20"):
        eng.add_request([1] * 500, SamplingParams(max_tokens=10))
    eng.add_request([1, 2], GREEDY)
    eng.add_request([3, 4], GREEDY)
    with pytest.raises(Overloaded) as exc:
        eng.add_request([5, 6], GREEDY)
    assert exc.value.retry_after > 0 and "2 requests" in str(exc.value)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([10_000], GREEDY)
    with pytest.raises(TypeError, match="a prompt is a string or a list of token ids, got NoneType"):
        eng.add_request(None, GREEDY)
    with pytest.raises(TypeError, match=r"params must be a k3.serve.sampling.SamplingParams, got dict"):
        eng.add_request([1, 2], {"temperature": 0})
    assert len(eng.scheduler.waiting) == 2  # nothing bad was queued


def test_randomized_workload_returns_every_page(model):
    rng = random.Random(7)
    eng = engine(
        model,
        num_pages=120,
        caching=True,
        max_batched_tokens=48,
        max_num_seqs=8,
        max_waiting_requests=1000,
        reserve_output_fraction=0.5,
    )
    base = [rng.randrange(256) for _ in range(48)]
    live, finished, aborted = [], 0, 0
    for i in range(300):
        prompt = (base[: rng.randrange(0, 48)] if rng.random() < 0.5 else []) + [
            rng.randrange(256) for _ in range(rng.randrange(1, 40))
        ]
        params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randrange(1, 12), seed=i)
        live.append(eng.add_request(prompt, params))
        if rng.random() < 0.1 and live:
            aborted += eng.abort(live.pop(rng.randrange(len(live))))
        for out in eng.step():
            finished += out.finished
        eng.pool.check()
    while eng.has_unfinished():
        finished += sum(o.finished for o in eng.step())
    assert finished + aborted == 300
    assert eng.pool.num_used == 0  # only cached (evictable) or free pages remain
    eng.pool.check()


def test_a_failed_forward_leaks_no_pages(model):
    """The forward raises (say, out of memory) in a step that reserved checkpoint pages: they come back,
    and the next steps recompute the same chunk and finish exactly."""
    eng = engine(model, num_pages=200, caching=True, max_batched_tokens=64)
    prompt = list(range(1, 60))
    want = generate(model, torch.tensor([prompt]), 4, temperature=0)[0, len(prompt) :].tolist()
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    run = eng.runner.run

    def failing(plan):
        assert plan.checkpoint_pages  # a checkpoint was reserved
        raise MemoryError("out of memory")

    eng.runner.run = failing
    with pytest.raises(MemoryError):
        eng.step()
    eng.runner.run = run
    tokens = []
    while eng.has_unfinished():
        tokens += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    assert tokens == want
    eng.cache.clear()
    assert eng.pool.num_used == 0
    eng.pool.check()
