"""AsyncEngine: one loop thread owns the engine; requests from threads and coroutines, each with its own
outputs; cancellation, shutdown and a failing step free every page. Every wait is bounded."""

import asyncio
import threading
import time

import pytest
import torch

from k3 import generate
from k3.formats.tokenizer import byte_tokenizer
from k3.serve.async_engine import AsyncEngine, EngineClosed
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import Overloaded, SchedulerConfig
from tiny_models import tiny_model

TOK = byte_tokenizer()
WAIT_S = 60  # bound on any single wait: a hang fails the test instead of stalling the run
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("bounded")  # these tests run threads: a hang must not stall the run


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=TOK.vocab_size)


@pytest.fixture
def make(model):
    """Build started AsyncEngines over fresh LLMEngines; at the end each is shut down (aborting what is left)
    and no loop thread may remain."""
    made = []

    def build(num_pages=400, caching=True, **sched) -> AsyncEngine:
        config = EngineConfig(num_pages=num_pages, enable_prefix_caching=caching, scheduler=SchedulerConfig(**sched))
        engine = AsyncEngine(LLMEngine(model, TOK, config))
        engine.start()
        made.append(engine)
        return engine

    yield build
    for engine in made:
        engine.shutdown(drain_timeout=0)
    # each engine's own loop thread is gone (other files' LLM objects may still hold theirs)
    assert not any(engine._thread is not None and engine._thread.is_alive() for engine in made)


def collect(handle) -> tuple[list[int], str, str]:
    """(tokens, text, finish_reason) of a handle, read to its end with bounded waits."""
    tokens, text, last = [], "", None
    for last in handle.outputs(timeout=WAIT_S):
        tokens += last.new_token_ids
        text += last.new_text
    return tokens, text, last.finish_reason


def assert_pool_free(engine: AsyncEngine) -> None:
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["pages_used"] == 0, stats
    engine.engine.pool.check()


def reference(model, prompt: list[int], n: int) -> list[int]:
    return generate(model, torch.tensor([prompt]), n, temperature=0)[0, len(prompt) :].tolist()


def test_requests_from_many_threads_each_get_their_own_tokens(make, model):
    engine = make(max_batched_tokens=32)
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((3, 17, 40, 9, 25, 12, 5, 30))]
    results: dict[int, tuple] = {}

    def client(i: int) -> None:
        results[i] = collect(engine.submit(prompts[i], GREEDY))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT_S)
    assert sorted(results) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        assert results[i][0] == reference(model, prompt, 6) and results[i][2] == "length"
    assert_pool_free(engine)


def test_asyncio_consumers_do_not_block_the_event_loop(make, model):
    engine = make()
    prompts = [list(range(10, 10 + n)) for n in (4, 11, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def consume(prompt) -> list[int]:
        handle = await engine.submit_async(prompt, params)
        tokens = []
        async for out in handle:
            tokens += out.new_token_ids
        return tokens

    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        tick_task = asyncio.create_task(ticker())
        got = await asyncio.wait_for(asyncio.gather(*(consume(p) for p in prompts)), WAIT_S)
        done.set()
        await tick_task
        return got, ticks

    got, ticks = asyncio.run(main())
    assert got == [reference(model, p, 12) for p in prompts]
    assert ticks >= 5  # the event loop kept running while the requests were generated
    assert_pool_free(engine)


def test_cancel_frees_the_request_and_ends_its_iterators(make):
    engine = make(caching=False)
    handle = engine.submit(list(range(1, 30)), SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    outputs = handle.outputs(timeout=WAIT_S)
    first = next(outputs)
    assert not first.finished and not handle.finished
    handle.cancel()
    handle.cancel()  # idempotent
    rest = list(outputs)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert handle.finished and handle.wait(timeout=0)
    assert sum(len(o.new_token_ids) for o in [first, *rest]) < 2000
    assert list(handle.outputs(timeout=1)) == []  # a finished, read handle yields nothing more
    assert_pool_free(engine)
    after = engine.submit([1, 2, 3], GREEDY)
    assert collect(after)[2] == "length"
    after.cancel()  # after the end: changes nothing
    assert_pool_free(engine)


def test_cancel_with_stop_ends_the_request_with_stop_in_the_engine_too(make):
    """A caller that found the end itself (the server's chat stop strings) cancels with "stop": the last output
    and the engine's record of the request both say stop; other reasons are refused."""
    engine = make(caching=False)
    handle = engine.submit(list(range(1, 30)), SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    seq = engine.engine.seqs[handle.request_id]  # the engine's record, read again once the request is over
    outputs = handle.outputs(timeout=WAIT_S)
    next(outputs)
    with pytest.raises(ValueError, match="abort or stop"):
        handle.cancel("length")
    handle.cancel("stop")
    rest = list(outputs)
    assert rest[-1].finished and rest[-1].finish_reason == "stop" and seq.finish_reason == "stop"
    assert_pool_free(engine)


def test_cancel_from_a_coroutine(make):
    engine = make()

    async def main():
        handle = await engine.submit_async([5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True))
        reasons = []
        async for out in handle:
            if not reasons:
                handle.cancel()
            reasons.append(out.finish_reason)
        return reasons

    reasons = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert reasons[-1] == "abort" and len(reasons) < 2000
    assert_pool_free(engine)


def test_a_submission_given_up_while_waiting_is_cancelled(make):
    """A coroutine cancelled (its client gone) while the loop is busy with a slow step and has not yet added
    its request: the request, added after all, is aborted rather than left running with no reader."""
    engine = make()
    step = engine.engine.step
    engine.engine.step = lambda: time.sleep(0.05) or step()
    busy = engine.submit([1, 2, 3], SamplingParams(max_tokens=2000, ignore_eos=True))

    async def give_up() -> None:
        task = asyncio.create_task(engine.submit_async([4, 5, 6], SamplingParams(max_tokens=2000, ignore_eos=True)))
        await asyncio.sleep(0.01)  # the loop is inside a step: the submission waits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(give_up(), WAIT_S))
    busy.cancel()
    assert busy.wait(WAIT_S)
    assert_pool_free(engine)  # stats is queued after the add and its cancellation


def test_admission_errors_are_raised_in_the_caller(make):
    engine = make(num_pages=20, max_num_seqs=1, max_waiting_requests=2)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.submit([], GREEDY)
    with pytest.raises(TypeError, match=r"params must be a k3\.serve\.sampling\.SamplingParams, got dict"):
        engine.submit([1, 2], {"temperature": 0})
    with pytest.raises(ValueError, match=r"needs .* pages .* but the pool has 20"):
        engine.submit([1] * 500, SamplingParams(max_tokens=10))
    handle = engine.submit([1, 2], SamplingParams(max_tokens=200, ignore_eos=True), request_id="mine")
    assert handle.request_id == "mine"
    with pytest.raises(ValueError, match="request id 'mine' is already in use"):
        engine.submit([1, 2], GREEDY, request_id="mine")
    # one runs, two may wait: a fourth request at most finds the queue full
    queued = [handle]
    with pytest.raises(Overloaded) as exc:
        for _ in range(3):
            queued.append(engine.submit([3, 4], SamplingParams(max_tokens=200, ignore_eos=True)))
    assert exc.value.retry_after > 0
    for h in queued:
        h.cancel()
    assert all(h.wait(WAIT_S) for h in queued)
    assert_pool_free(engine)


def test_shutdown_drains_then_refuses(make, model):
    engine = make()
    prompts = [[7, 8, 9], list(range(20, 45))]
    handles = [engine.submit(p, GREEDY) for p in prompts]
    engine.shutdown(drain_timeout=WAIT_S)
    assert [collect(h)[0] for h in handles] == [reference(model, p, 6) for p in prompts]
    with pytest.raises(EngineClosed):
        engine.submit([1, 2], GREEDY)
    assert not engine._thread.is_alive()
    assert_pool_free(engine)  # read directly now that the loop has stopped
    engine.shutdown()  # idempotent


def test_shutdown_past_the_drain_timeout_aborts(make):
    engine = make(caching=False)
    handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=3000, ignore_eos=True))
    next(handle.outputs(timeout=WAIT_S))
    engine.shutdown(drain_timeout=0.05)
    tokens, _, reason = collect(handle)
    assert reason == "abort" and len(tokens) < 3000
    assert_pool_free(engine)


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(make, model):
    engine = make()
    llm_engine = engine.engine
    run = llm_engine.runner.run
    failures = []

    def failing_once(plan):
        if not failures:
            failures.append([p.seq.request_id for p in plan.pieces])
            raise MemoryError("out of memory in the forward")
        return run(plan)

    llm_engine.runner.run = failing_once
    bad = engine.submit(list(range(1, 60)), GREEDY)
    outs = list(bad.outputs(timeout=WAIT_S))
    assert failures == [[bad.request_id] * len(failures[0])]
    assert outs[-1].finished and outs[-1].finish_reason == "error"
    assert outs[-1].error == "MemoryError: out of memory in the forward"
    assert_pool_free(engine)  # its pages and the checkpoint pages of the failed step are back
    good = engine.submit([4, 5, 6], GREEDY)
    assert collect(good)[0] == reference(model, [4, 5, 6], 6)
    assert_pool_free(engine)


def test_an_idle_loop_waits_instead_of_spinning(make):
    engine = make()
    collect(engine.submit([1, 2, 3], GREEDY))
    steps = []
    step = engine.engine.step
    engine.engine.step = lambda: steps.append(1) or step()
    cpu = time.process_time()
    time.sleep(0.3)
    assert steps == [] and time.process_time() - cpu < 0.1
    assert collect(engine.submit([1, 2, 3], GREEDY))[2] == "length" and len(steps) >= 6
