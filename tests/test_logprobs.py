"""Log-probabilities: SamplingParams.logprobs in the engine (exact against an uncached forward of the float64
tiny model), their checks, the offline LLM's Completion, and both OpenAI formats through the server read by
the unmodified `openai` client (completion and chat, streamed and not)."""

import math

import openai
import pytest
import torch

from k3.chat import ChatEncoder
from k3.cli import main
from k3.formats.tokenizer import byte_tokenizer
from k3.serve.async_engine import AsyncEngine
from k3.serve.detokenizer import IncrementalDetokenizer
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.llm import LLM
from k3.serve.sampling import MAX_LOGPROBS, SamplingParams, token_logprobs
from k3.serve.scheduler import SchedulerConfig
from k3.server import ServerLimits
from k3.server.app import create_app
from k3.server.logprobs import TokenText
from server_helpers import ServerThread
from tiny_models import tiny_model

TOK = byte_tokenizer()
MODEL = "tiny"


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=TOK.vocab_size)


def run(eng: LLMEngine, prompts, params) -> list[list]:
    """Every request's outputs, in prompt order."""
    ids = [eng.add_request(p, params) for p in prompts]
    outs = {i: [] for i in ids}
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.request_id].append(out)
    return [outs[i] for i in ids]


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T, V) log_softmax of one uncached forward's logits, in float64."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def test_greedy_logprobs_equal_an_uncached_forward(model):
    # chunked prefill (max_batched_tokens 16 < the 40-token prompt) then decode, batched with other prompts
    prompts = [list(range(5, 5 + n)) for n in (40, 3, 17)]
    eng = LLMEngine(model, TOK, EngineConfig(num_pages=400, scheduler=SchedulerConfig(max_batched_tokens=16)))
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=5)
    for prompt, outs in zip(prompts, run(eng, prompts, params), strict=True):
        tokens = [t for o in outs for t in o.new_token_ids]
        entries = [e for o in outs for e in o.logprobs]
        assert all(len(o.logprobs) == len(o.new_token_ids) == 1 for o in outs)
        ref_TV = reference_logprobs(model, prompt + tokens)[len(prompt) - 1 : -1]  # the rows that chose each token
        for t, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(ref_TV[t, token].item(), abs=1e-9)
            assert entry.logprob == pytest.approx(ref_TV[t].max().item(), abs=1e-9)  # greedy: the chosen is top-1
            assert len(entry.top) == 5 and entry.top[0] == (token, entry.logprob)
            values = [v for _, v in entry.top]
            assert values == sorted(values, reverse=True)
            ref_values, ref_ids = ref_TV[t].topk(5)
            assert [i for i, _ in entry.top] == ref_ids.tolist()
            assert values == pytest.approx(ref_values.tolist(), abs=1e-9)
            assert math.fsum(math.exp(v) for v in ref_TV[t].tolist()) == pytest.approx(1.0)


def test_sampled_logprobs_are_the_raw_distribution_not_the_tempered_one(model):
    prompt = list(range(10, 30))
    eng = LLMEngine(model, TOK, EngineConfig(num_pages=400))
    params = SamplingParams(temperature=1.7, top_k=3, max_tokens=5, ignore_eos=True, seed=3, logprobs=2)
    (outs,) = run(eng, [prompt], params)
    tokens = [o.new_token_ids[0] for o in outs]
    ref_TV = reference_logprobs(model, prompt + tokens)[len(prompt) - 1 : -1]
    for t, o in enumerate(outs):
        (entry,) = o.logprobs
        assert entry.logprob == pytest.approx(ref_TV[t, tokens[t]].item(), abs=1e-9)  # log_softmax(logits), no 1/T
        assert [v for _, v in entry.top] == pytest.approx(ref_TV[t].topk(2).values.tolist(), abs=1e-9)


def test_logprobs_off_or_zero(model):
    eng = LLMEngine(model, TOK, EngineConfig(num_pages=400))
    (off,) = run(eng, [[1, 2, 3]], None)
    assert all(o.logprobs is None for o in off)
    (zero,) = run(eng, [[4, 5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0))
    assert all(len(o.logprobs) == 1 and o.logprobs[0].top == () for o in zero)
    assert all(o.logprobs[0].logprob < 0 for o in zero)


def test_rows_that_do_not_ask_get_nothing_and_each_row_its_own_length():
    logits_BV = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 5.0]])
    tokens_B = torch.tensor([3, 1, 0])
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=1)]
    a, b, c = token_logprobs(logits_BV, tokens_B, params)
    assert b is None
    expected = torch.log_softmax(logits_BV, -1)
    assert a.token_id == 3 and a.logprob == pytest.approx(expected[0, 3].item())
    assert [i for i, _ in a.top] == [3, 2, 1]
    assert c.token_id == 0 and c.logprob == pytest.approx(expected[2, 0].item())
    assert [i for i, _ in c.top] == [3] and c.top[0][1] == pytest.approx(expected[2, 3].item())


def test_bfloat16_logits_are_computed_in_fp32():
    logits_BV = torch.randn(2, 300, generator=torch.Generator().manual_seed(0)).bfloat16()
    (entry, _) = token_logprobs(logits_BV, torch.tensor([7, 8]), [SamplingParams(logprobs=2), SamplingParams()])
    expected = torch.log_softmax(logits_BV.float(), -1)[0]
    assert entry.logprob == expected[7].item()  # exactly fp32's value, not bfloat16's rounding of it
    assert [v for _, v in entry.top] == expected.topk(2).values.tolist()


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="logprobs must be None"):
        SamplingParams(logprobs=bad)
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == 20


# ---- the server: OpenAI's formats, read by the official client


@pytest.fixture(scope="module")
def served(model):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = AsyncEngine(LLMEngine(model, TOK, EngineConfig(num_pages=400)))
        engine.start()
        # 512: the default thinking-effort message alone is ~300 byte tokens of the prompt
        app = create_app(engine, MODEL, ServerLimits(max_model_len=512, max_tokens=32, max_n=2))
        with ServerThread(app) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        engine.shutdown(drain_timeout=0)
    finally:
        torch.set_num_threads(threads)


TEXTS = TokenText(TOK)
GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}


def greedy_reference(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens by uncached forwards, and the (n, V) log-probabilities each was chosen from."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(reference_logprobs(model, ids)[-1].argmax()))
    return ids[len(prompt) :], reference_logprobs(model, ids)[len(prompt) - 1 : -1]


def test_completion_logprobs_in_openai_legacy_format(served, model):
    prompt = "logprobs, please: "
    tokens, ref_TV = greedy_reference(model, TOK.encode(prompt), 6)
    done = served.completions.create(prompt=prompt, logprobs=3, **GREEDY)
    lp = done.choices[0].logprobs
    assert lp.tokens == [TEXTS.text(t) for t in tokens]
    assert lp.token_logprobs == pytest.approx([ref_TV[k, t].item() for k, t in enumerate(tokens)], abs=1e-9)
    for k, top in enumerate(lp.top_logprobs):
        values, ids = ref_TV[k].topk(3)
        assert list(top) == [TEXTS.text(i) for i in ids.tolist()]  # most likely first
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-9)
        assert lp.token_logprobs[k] == pytest.approx(max(top.values()), abs=1e-12)  # greedy: the top-1
    # each token's text starts where the text so far ends (a token that ends inside a character: where it resumes)
    detok, offsets, emitted = IncrementalDetokenizer(TOK), [], 0
    for k in range(len(tokens)):
        offsets.append(emitted)
        emitted += len(detok.step(tokens[: k + 1], final=k == len(tokens) - 1))
    assert lp.text_offset == offsets and emitted == len(done.choices[0].text)

    streamed = list(served.completions.create(prompt=prompt, logprobs=3, stream=True, **GREEDY))
    parts = [ch.choices[0].logprobs for ch in streamed if ch.choices]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    # the second request reads its prompt from the prefix cache: the same values to fp64 rounding
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-9)
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    tops = [d for p in parts for d in p.top_logprobs]
    assert [list(d) for d in tops] == [list(d) for d in lp.top_logprobs]
    flat = [v for d in lp.top_logprobs for v in d.values()]
    assert [v for d in tops for v in d.values()] == pytest.approx(flat, abs=1e-9)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == done.choices[0].text

    plain = served.completions.create(prompt=prompt, **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == done.choices[0].text
    zero = served.completions.create(prompt=prompt, logprobs=0, **GREEDY).choices[0].logprobs
    assert zero.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-9) and zero.top_logprobs == [{}] * 6


def test_chat_logprobs_in_openai_format(served, model):
    messages = [{"role": "user", "content": "hi"}]
    prompt = ChatEncoder(TOK).render(messages, thinking=True).ids
    tokens, ref_TV = greedy_reference(model, prompt, 6)
    done = served.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    content = done.choices[0].logprobs.content
    n = done.usage.completion_tokens
    assert len(content) == n  # one entry per generated token, the chat format's structure and reasoning included
    for k, entry in enumerate(content):
        t = tokens[k]
        assert entry.token == TEXTS.text(t) and bytes(entry.bytes) == TEXTS.bytes(t)
        assert entry.logprob == pytest.approx(ref_TV[k, t].item(), abs=1e-9)
        values, ids = ref_TV[k].topk(2)
        assert [a.token for a in entry.top_logprobs] == [TEXTS.text(i) for i in ids.tolist()]
        assert [bytes(a.bytes) for a in entry.top_logprobs] == [TEXTS.bytes(i) for i in ids.tolist()]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-9)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-12)

    streamed = list(
        served.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, stream=True, **GREEDY)
    )
    entries = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.bytes, [(a.token, a.bytes) for a in e.top_logprobs]) for e in entries] == [
        (e.token, e.bytes, [(a.token, a.bytes) for a in e.top_logprobs]) for e in content
    ]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-9)

    no_top = served.chat.completions.create(messages=messages, logprobs=True, **GREEDY).choices[0].logprobs
    assert [e.logprob for e in no_top.content] == pytest.approx([e.logprob for e in content], abs=1e-9)
    assert all(e.top_logprobs == [] for e in no_top.content)
    assert served.chat.completions.create(messages=messages, **GREEDY).choices[0].logprobs is None


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
    ],
)
def test_chat_logprobs_refused_by_name(served, kwargs, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        served.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kwargs, **GREEDY)
    error = e.value.body
    assert error["param"] == param and needle in error["message"]


@pytest.mark.parametrize(("logprobs", "needle"), [(21, "less than or equal to 20"), (-1, "greater than or equal")])
def test_completion_logprobs_refused_by_name(served, logprobs, needle):
    with pytest.raises(openai.BadRequestError) as e:
        served.completions.create(prompt="x", logprobs=logprobs, **GREEDY)
    assert e.value.body["param"] == "logprobs" and needle in e.value.body["message"]


def test_each_of_n_sampled_choices_gets_its_own_logprobs(served):
    done = served.completions.create(
        prompt="two ways: ",
        n=2,
        logprobs=2,
        seed=5,
        model=MODEL,
        max_tokens=5,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    first, second = (c.logprobs for c in sorted(done.choices, key=lambda c: c.index))
    assert len(first.tokens) == len(second.tokens) == 5 and first.tokens != second.tokens
    for lp in (first, second):
        for top in lp.top_logprobs:
            assert len(top) == 2 and list(top.values()) == sorted(top.values(), reverse=True)
        assert all(v < 0 for v in lp.token_logprobs)


def test_offline_llm_returns_one_logprob_per_token(tmp_path):
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    with LLM(str(tmp_path), memory_budget=8 << 20) as llm:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=4)
        out, plain = llm.generate(["def f(x):", "def f(x):"], [params, SamplingParams(temperature=0, max_tokens=5)])
    assert [e.token_id for e in out.logprobs] == out.token_ids and plain.logprobs is None
    assert all(len(e.top) == 4 and e.top[0] == (e.token_id, e.logprob) for e in out.logprobs)
