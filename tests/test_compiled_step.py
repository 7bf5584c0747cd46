"""The serving step compiled (k3.serve.compiled_step) against the eager engine, its reference: the same greedy
tokens and log-probabilities to fp64 rounding, through prefill chunks, prefix-cache hits, decode batches and
preemption; the seams' operators against what they stand for; the settings' errors."""

import random

import pytest
import torch

from k3.formats.tokenizer import byte_tokenizer
from k3.model.moe import moe_experts
from k3.model.quantization import pack_experts, set_expert_quantization
from k3.ops import moe_cpu
from k3.serve.compiled_step import StepContext, compile_blocker, resolve, step_context
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig
from tiny_models import tiny_model

TOK = byte_tokenizer()
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=TOK.vocab_size, router_bias_std=0.3)


def engine(model, compile: bool, num_pages=400, caching=True, **sched) -> LLMEngine:
    config = EngineConfig(
        num_pages=num_pages, enable_prefix_caching=caching, scheduler=SchedulerConfig(**sched), compile=compile
    )
    return LLMEngine(model, TOK, config)


def run(eng: LLMEngine, prompts, params=PARAMS) -> list[tuple[list[int], list[float]]]:
    """Each prompt's tokens and their log-probabilities, every request added at once."""
    ids = [eng.add_request(p, params) for p in prompts]
    out = {i: ([], []) for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.logprobs or ())
    return [out[i] for i in ids]


def assert_same(compiled, eager):
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(compiled, eager, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), rtol=0, atol=1e-9)


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(40)]
    return [system + [rng.randrange(256) for _ in range(rng.randrange(1, 45))] for _ in range(n)]


def test_compiled_engine_equals_eager_through_chunks_cache_hits_and_batches(model):
    """Chunked prefills beside decode rows (a 16-token budget), then a second wave that hits the prefix cache:
    the compiled engine's tokens are the eager engine's, and so are their log-probabilities."""
    first, second = prompts(0, 5), prompts(0, 9)[5:]
    eager = engine(model, compile=False, max_batched_tokens=16)
    compiled = engine(model, compile=True, max_batched_tokens=16)
    assert compiled.runner.compiled is not None and eager.runner.compiled is None
    for wave in (first, second):
        assert_same(run(compiled, wave), run(eager, wave))
    assert compiled.metrics()["state_hit_tokens"] > 0
    assert compiled.runner.compiled.compile_seconds > 0
    compiled.pool.check()


def test_compiled_engine_keeps_results_exact_under_preemption(model):
    ps = [list(range(1, 1 + n)) for n in (30, 31, 32, 33)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    pages = 2 * (3 + 5)  # two requests' worth: the others are preempted and recomputed
    eager = run(engine(model, compile=False, num_pages=pages, caching=False, reserve_output_fraction=0.0), ps, params)
    eng = engine(model, compile=True, num_pages=pages, caching=False, reserve_output_fraction=0.0)
    assert_same(run(eng, ps, params), eager)
    assert eng.metrics()["preemptions"] > 0 and eng.pool.num_used == 0


@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_packed_experts_compiled_equal_eager(quantization):
    """MXFP4-packed experts behind k3::moe_experts_mxfp4 (the kernel reading the packed bytes), with plain and
    with MXFP8 inputs: the compiled engine's tokens and log-probabilities are the eager engine's, whose experts
    are dequantised per call."""
    packed = tiny_model(vocab_size=TOK.vocab_size, router_bias_std=0.3)
    with torch.no_grad():  # experts whose outputs matter to the logits
        for name, p in packed.named_parameters():
            if ".experts." in name:
                p.normal_(std=0.2)
    pack_experts(packed)
    set_expert_quantization(packed, quantization)
    ps = prompts(5, 4)
    assert_same(run(engine(packed, compile=True, max_batched_tokens=24), ps), run(engine(packed, compile=False), ps))


def test_speculative_decoding_through_the_compiled_step(model):
    """Verification steps (proposal rows, rolled back afterwards, by snapshot and by replay) and the draft's block
    summaries come from the compiled graph: the greedy tokens equal the eager engine's with the same draft, and
    plain decoding's."""
    from k3.spec.draft import DraftModel

    ps = prompts(3, 4)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    draft = DraftModel(model.config).double()
    results = []
    runs = [(False, False, "snapshot"), (False, True, "snapshot"), (True, True, "snapshot"), (True, True, "replay")]
    for compile, spec, rollback in runs:
        config = EngineConfig(num_pages=400, compile=compile, num_speculative_tokens=3, spec_rollback=rollback)
        eng = LLMEngine(model, TOK, config, draft=draft if spec else None)
        results.append([tokens for tokens, _ in run(eng, ps, params)])
        if spec:
            assert eng.spec_stats.proposed > eng.spec_stats.accepted  # rejections: rows were rolled back
        if compile:
            assert eng.runner.compiled is not None and eng.runner.compiled._seen == {(1, 2, 3)}
    assert results[3] == results[2] == results[1] == results[0]


@pytest.mark.parametrize("kernel", [True, False])
def test_moe_experts_operator_equals_the_module_dispatch(model, monkeypatch, kernel):
    """k3::moe_experts (the compiled graph's seam; the C++ kernel k3_cpu::moe_experts, or its PyTorch path)
    computes LatentMoE.dispatch, for odd token counts, with SiTU and with SwiGLU."""
    if not kernel:
        monkeypatch.setattr(moe_cpu, "usable", lambda *a: False)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    monkeypatch.setattr(moe, "act", moe.act)
    torch.manual_seed(0)
    for T, act in [(1, "situ"), (3, "situ"), (17, "situ"), (5, "silu")]:
        moe.act = (act, *moe.act[1:])
        x = torch.randn(T, model.config.hidden_size, dtype=torch.float64)
        routing = moe.gate(x)
        z = moe.routed_expert_down_proj(x)
        with torch.no_grad():
            want = moe.dispatch(z, routing)
            got = moe_experts(
                z,
                routing.experts_TK,
                routing.weights_TK,
                [ex.w1.weight for ex in moe.experts],
                [ex.w3.weight for ex in moe.experts],
                [ex.w2.weight for ex in moe.experts],
                *moe.act,
            )
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_mix_operator_outside_a_step_says_so():
    with pytest.raises(RuntimeError, match="inside a compiled serving step"):
        torch.ops.k3_step.mix([torch.zeros(1, 2, 3)], 0, 1, 3)
    with step_context(StepContext(batch=None, mixers=[])):  # the context is per thread and restored after
        pass
    with pytest.raises(RuntimeError, match="inside a compiled serving step"):
        torch.ops.k3_step.mix([torch.zeros(1, 2, 3)], 0, 1, 3)


def test_compile_settings(model, monkeypatch):
    assert compile_blocker(model) is None
    assert resolve(model, False) is False and resolve(model, True) is True
    monkeypatch.setenv("K3_COMPILE", "auto")
    assert resolve(model, None) is True
    monkeypatch.setenv("K3_COMPILE", "off")
    assert resolve(model, None) is False
    monkeypatch.setenv("K3_COMPILE", "yes")
    with pytest.raises(ValueError, match=r"K3_COMPILE must be one of \('auto', 'on', 'off'\), got 'yes'"):
        resolve(model, None)
    with pytest.raises(ValueError, match="compile must be None"):
        EngineConfig(num_pages=10, compile="yes")
    quantized = tiny_model(vocab_size=TOK.vocab_size, expert_quantization="mxfp4")
    assert 'load with quantization="mxfp4"' in compile_blocker(quantized)
    with pytest.raises(ValueError, match=r"compile=True, but the dense routed experts .*--no-compile"):
        resolve(quantized, True)
    pack_experts(quantized)
    assert compile_blocker(quantized) is None
    set_expert_quantization(quantized, None)
    assert compile_blocker(quantized) is None
    quantized = tiny_model(vocab_size=TOK.vocab_size, expert_quantization="mxfp4")
    monkeypatch.setenv("K3_COMPILE", "auto")
    assert resolve(quantized, None) is False  # auto: eager, with the reason logged
