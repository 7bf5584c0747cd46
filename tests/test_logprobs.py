"""Log-probabilities: SamplingParams.logprobs in the engine (exact against an uncached forward of the float64
tiny model), their checks, the offline LLM's Completion, and both OpenAI formats through the server read by
the unmodified `openai` client (completion and chat, streamed and not)."""

import math

import pytest
import torch

from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import MAX_LOGPROBS, SamplingParams, token_logprobs
from k3.serve.scheduler import SchedulerConfig
from k3.train.tokenizer import byte_tokenizer
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
