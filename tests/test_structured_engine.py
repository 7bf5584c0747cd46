"""Structured outputs end to end on the engine with a random-weight tiny model: what a schema-constrained
request writes is JSON that satisfies the schema (greedy, sampled, seeded or not), a request batched beside
it is unaffected, preemption and speculative decoding keep it exact, log-probabilities stay the model's,
and a constrained request that fails fails alone."""

import json
import re

import pytest
import torch

import k3.serve.engine as engine_module
from k3.formats.tokenizer import train_tokenizer
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams, sample
from k3.serve.scheduler import SchedulerConfig
from k3.spec.draft import DraftModel
from k3.structured import GrammarError, Json, Literal, Sequence, Special, Vocabulary
from test_structured_matcher import TEXTS
from tiny_models import tiny_model

jsonschema = pytest.importorskip("jsonschema")

TOK = train_tokenizer(TEXTS, vocab_size=600)
VOCAB = Vocabulary.of(TOK)
PROMPT = TOK.encode('Weather as JSON: {"city": "Oslo"}')
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
        "required": ["name", "ok"],
    },
    {"type": "array", "items": {"type": ["integer", "null"]}, "maxItems": 3},
    {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "object", "properties": {"k": {"const": "v"}}}]},
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
                    "required": ["id", "tag"],
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
]
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.8, "top_p": 0.9}]


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=TOK.vocab_size)


def make(model, draft=None, **sched) -> LLMEngine:
    pages, caching = sched.pop("num_pages", 400), sched.pop("caching", True)
    config = EngineConfig(num_pages=pages, enable_prefix_caching=caching, scheduler=SchedulerConfig(**sched))
    return LLMEngine(model, TOK, config, draft=draft)


def run(eng: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], str, str]]:
    """(tokens, finish_reason, error) of each request, all added before the first step."""
    ids = [eng.add_request(prompt, params) for prompt, params in requests]
    out = {i: ([], None, None) for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = (out[o.request_id][0] + o.new_token_ids, o.finish_reason, o.error)
    assert eng.pool.num_used == 0
    return [out[i] for i in ids]


def decoded(tokens: list[int]) -> object:
    data = b"".join(bytes(VOCAB.symbols(t)) for t in tokens if t != TOK.eos_id)
    return json.loads(data.decode("utf-8"))


def constrained(schema, max_tokens=150, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, grammar=Json(schema, max_whitespace=2), **kwargs)


def test_the_sampler_draws_allowed_tokens_only_and_leaves_other_rows_alone():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    before = logits.clone()
    allowed = torch.zeros(50, dtype=torch.bool)
    allowed[[3, 17, 41]] = True
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=1.3, top_k=2),
        SamplingParams(temperature=1.0, seed=5),
    ]
    masks = [allowed, allowed, allowed, None]
    drawn = torch.stack([sample(logits, params, [n] * 4, masks) for n in range(30)])
    assert set(drawn[:, :3].flatten().tolist()) <= {3, 17, 41} and torch.equal(logits, before)
    assert drawn[0, 0] == [3, 17, 41][int(logits[0, [3, 17, 41]].argmax())]  # greedy: the best allowed token
    alone = torch.stack([sample(logits[3:], params[3:], [n]) for n in range(30)])
    assert torch.equal(drawn[:, 3:], alone)  # the unmasked row draws what it draws without the others
    restricted = logits[1:2].masked_fill(~allowed, float("-inf"))  # seeded: the race over the restricted distribution
    assert torch.equal(drawn[:, 1], torch.stack([sample(restricted, params[1:2], [n]) for n in range(30)])[:, 0])


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array", "anyOf", "nested"])
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded", "unseeded"])
def test_a_constrained_request_writes_json_that_satisfies_its_schema(model, schema, sampling):
    torch.manual_seed(0)
    [(tokens, reason, error)] = run(make(model), [(PROMPT, constrained(schema, **sampling))])
    assert reason == "stop" and error is None and tokens[-1] == TOK.eos_id
    jsonschema.validate(decoded(tokens), schema)


def test_an_unconstrained_request_beside_one_is_unaffected(model):
    other = [
        (TOK.encode("def f(x):"), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
        (TOK.encode("reasoning"), SamplingParams(temperature=1.0, seed=9, max_tokens=20, ignore_eos=True)),
    ]
    alone = run(make(model), other)
    grammar = [(PROMPT, constrained(SCHEMAS[0], temperature=0)), (PROMPT, constrained(SCHEMAS[3], seed=1))]
    batched = run(make(model), [grammar[0], other[0], grammar[1], other[1]])
    assert [batched[1], batched[3]] == alone
    for (tokens, reason, _), schema in zip([batched[0], batched[2]], [SCHEMAS[0], SCHEMAS[3]], strict=True):
        assert reason == "stop"
        jsonschema.validate(decoded(tokens), schema)


def test_preemption_keeps_constrained_output_exact(model):
    """Recompute keeps the tokens and leaves the matcher where the output is: a preempted request writes what
    it writes unpressured (the matcher advanced twice over its tokens would refuse or change them)."""
    prompts = [PROMPT + TOK.encode(" " * n) for n in (20, 25, 30, 35)]
    requests = [(p, constrained(SCHEMAS[3], temperature=0, max_tokens=128)) for p in prompts]
    plain = run(make(model, caching=False), requests)
    eng = make(model, num_pages=2 * (3 + 6), caching=False, reserve_output_fraction=0.0)
    assert run(eng, requests) == plain and eng.metrics()["preemptions"] > 0
    for tokens, reason, _ in plain:  # room to finish: the longest takes 112 tokens on this model
        assert reason == "stop"
        jsonschema.validate(decoded(tokens), SCHEMAS[3])


def test_constrained_requests_get_no_proposals_with_a_draft(model):
    draft = DraftModel(model.config, num_speculative_tokens=3).double()
    requests = [
        (PROMPT, constrained(SCHEMAS[0], temperature=0)),
        (TOK.encode("def f(x):"), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
    ]
    want = run(make(model), requests)
    eng = make(model, draft=draft)
    assert run(eng, requests) == want
    assert eng.metrics()["spec_proposed_tokens"] > 0  # the unconstrained request speculated
    seq = engine_module.Sequence("x", PROMPT, requests[0][1], matcher=eng.grammars.matcher(requests[0][1].grammar))
    assert eng.proposer.room(seq) == 0


def test_logprobs_are_the_raw_model_distribution(model):
    params = constrained(SCHEMAS[1], temperature=0, logprobs=5)
    eng = make(model)
    rid = eng.add_request(PROMPT, params)
    free = eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    first = {o.request_id: o.logprobs[0] for o in eng.step()}
    # the same raw distribution: the grammar changes the draw only. The two rows are one prompt at two places
    # of a packed batch, and MKL's GEMM gives a row other last bits by where it falls in its blocking (the MoE's
    # expert runs): logits agree to ~1e-16, not bit for bit, so the values are compared to rel 1e-12 (AttnRes's
    # softmax had the same dependence in k3's own code and now has none: test_attn_res_backward.py)
    constrained_top, free_top = first[rid].top, first[free].top
    assert [t for t, _ in constrained_top] == [t for t, _ in free_top]
    assert [lp for _, lp in constrained_top] == pytest.approx([lp for _, lp in free_top], rel=1e-12, abs=0)
    assert first[rid].token_id == TOK.encode("[")[0] != first[free].token_id
    while eng.has_unfinished():
        eng.step()


def test_failures_of_a_constrained_request_stay_its_own(model, monkeypatch):
    requests = [
        (PROMPT, constrained(SCHEMAS[0], temperature=0)),
        (TOK.encode("def f(x):"), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    ]
    reference = run(make(model), requests)
    eng = make(model)
    bad = eng.add_request(*requests[0])
    good = eng.add_request(*requests[1])
    eng.step()

    def broken():
        raise GrammarError("no token of the vocabulary continues the grammar here")

    eng.seqs[bad].matcher.mask = broken
    out = {bad: [], good: []}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].append((o.new_token_ids, o.finish_reason, o.error))
    assert out[bad][-1][1] == "error" and "GrammarError" in out[bad][-1][2]
    assert [t for step in out[good] for t in step[0]][-11:] == reference[1][0][-11:]
    # a token the grammar refuses (a sampler that ignored the mask) fails its request, not the batch
    real = engine_module.sample
    close = TOK.encode("]")[0]

    def ignores_masks(logits, params, positions, allowed=None):
        tokens = real(logits, params, positions, allowed)
        return torch.where(torch.tensor([a is not None for a in allowed or [None] * len(params)]), close, tokens)

    monkeypatch.setattr(engine_module, "sample", ignores_masks)
    result = run(make(model), requests)
    assert result[0][1] == "error" and "GrammarViolation" in result[0][2] and result[1] == reference[1]


def test_add_request_refuses_a_grammar_the_engine_cannot_follow(model):
    eng = make(model)
    with pytest.raises(ValueError, match=re.escape("special tokens the tokenizer does not have: <|nope|>")):
        eng.add_request(PROMPT, SamplingParams(grammar=Sequence(Literal("a"), Special("<|nope|>"))))
    with pytest.raises(ValueError, match=r"grammar must be None or a k3\.structured grammar"):
        SamplingParams(grammar={"type": "object"})
    assert not eng.has_unfinished() and not eng.seqs
    assert SamplingParams(grammar=Json(SCHEMAS[0])) == SamplingParams(grammar=Json(SCHEMAS[0]))  # frozen, hashable
    assert hash(SamplingParams(grammar=Json(SCHEMAS[0]))) == hash(SamplingParams(grammar=Json(SCHEMAS[0])))
    end = SamplingParams(temperature=0, max_tokens=50, grammar=Sequence(Literal("ok"), Special("<|end_of_msg|>")))
    [(tokens, reason, _)] = run(eng, [(PROMPT, end)])  # a grammar that ends with a token that is not a stop token
    assert reason == "stop" and tokens[-1] == TOK.eos_id and VOCAB.symbols(tokens[-2]) == ("<|end_of_msg|>",)
