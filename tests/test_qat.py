"""Quantisation-aware training of the routed experts (k3.quant.qat, SPEC §2.8): the in-place fake quantiser
equals the codec bit for bit; gradients are straight-through (checked by hand on a two-expert example) and
reach every parameter; a QAT model and the model served from its packed export compute the same logits,
bitwise in fp32, in a full forward and through the engine (chunked prefill, decode, prefix cache); `k3 train
--qat mxfp4` records it and starts from a full-precision checkpoint; torchao's MX quantiser agrees."""

import copy
import json
import warnings

import pytest
import torch

from k3 import K3Config, K3Model
from k3.cli import main
from k3.formats.tokenizer import byte_tokenizer
from k3.model import moe as moe_module
from k3.model.moe import LatentMoE
from k3.model.quantization import pack_experts, set_expert_quantization
from k3.model.situ import glu
from k3.quant import FP4_E2M1, FP8_E4M3, FP8_E5M2, MXFP4Linear, fake_quantize_mx, pack_mxfp4
from k3.quant.qat import fake_quantize
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig
from tiny_runs import tiny_train_args

FORMATS = [FP4_E2M1, FP8_E4M3, FP8_E5M2]
EXPONENT_RANGE = {
    torch.float32: (-150, 126),
    torch.bfloat16: (-135, 126),
    torch.float16: (-25, 14),
    torch.float64: (-300, 300),
}


def wide_range(dtype: torch.dtype, rows: int = 32, blocks: int = 64, seed: int = 0) -> torch.Tensor:
    """(rows, 32·blocks) values whose blocks sit in every binade of `dtype` (subnormals included), with an
    all-zero block, −0, NaN (either sign), ±inf, the largest finite value, exact ties of FP4 and E4M3, and
    saturating values."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = EXPONENT_RANGE[dtype]
    block_exp = torch.randint(lo, hi, (rows, blocks, 1), generator=g).double()
    spread = torch.randint(-12, 3, (rows, blocks, 32), generator=g).double()
    x = torch.randn(rows, blocks, 32, generator=g, dtype=torch.float64) * torch.exp2(block_exp + spread)
    x = x.flatten(1).to(dtype)
    x[0, :32] = 0.0
    x[0, 33] = -0.0
    x[1, :8] = torch.tensor([8, -8, 1, 3, 0.5, 7, 2.5, 6])  # the docs' worked example: 0.25, 3.5, 1.25 are ties
    x[2, :4] = torch.tensor([7.9, 1.0625, -1.1875, 0.001953125])  # saturation at amax 7.9; E4M3 ties
    x[3, 40], x[4, 70], x[5, 100] = float("nan"), float("inf"), -float("inf")
    x[6, 5] = -torch.tensor(float("nan"))  # a NaN with its sign bit set
    x[7, 0], x[7, 40] = torch.finfo(dtype).max, torch.finfo(dtype).tiny / 4  # the largest finite; a subnormal
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where the other is NaN (the codec's NaN is one fixed pattern; torch.nan may not be)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.uint8), b[~nan].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_fake_quantize_is_the_codec_bit_for_bit(dtype, fmt):
    x = wide_range(dtype)
    got = fake_quantize(x, fmt)
    assert got.dtype == dtype and same_bits(got, fake_quantize_mx(x, fmt))
    assert got[0, 33].item() == 0 and torch.signbit(got[0, 33])  # −0 stays −0
    assert got[3, 32:64].isnan().all() and not got[3, :32].isnan().any()  # NaN poisons its block only


def test_fake_quantize_hand_values():
    row = torch.zeros(1, 32)
    row[0, :8] = torch.tensor([8, -8, 1, 3, 0.5, 7, 2.5, 6])
    assert fake_quantize(row, FP4_E2M1)[0, :8].tolist() == [8, -8, 1, 3, 0, 8, 2, 6]  # docs/quantization.md
    row[0, :2] = torch.tensor([7.9, -3.0])  # amax 7.9: scale 1, so 7.9 and 7 saturate to 6; 2.5 ties to 2
    assert fake_quantize(row, FP4_E2M1)[0, :8].tolist() == [6, -3, 1, 3, 0.5, 6, 2, 6]
    row = torch.zeros(1, 32)
    row[0, :4] = torch.tensor([448.0, 1.0625, 1.1875, 500.0])  # amax 500: scale 2^0 (2^8 − 8 = 0); E4M3 ties
    assert fake_quantize(row, FP8_E4M3)[0, :4].tolist() == [448, 1.0, 1.25, 448]


def hand_sized_moe(dtype=torch.float64) -> LatentMoE:
    """Two experts of 32 x 32, MXFP4 / MXFP8: one block per row, so every quantiser is hand-checkable."""
    config = K3Config.from_preset(
        "tiny",
        routed_expert_hidden_size=32,
        moe_intermediate_size=32,
        num_experts=2,
        num_experts_per_token=1,
        expert_quantization="mxfp4",
    )
    torch.manual_seed(0)
    return LatentMoE(config).to(dtype)


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "per-expert"])
def test_gradients_are_straight_through_on_a_hand_sized_example(merged, monkeypatch):
    if not merged:
        monkeypatch.setattr(moe_module, "MERGE_ELEMENTS", 0)  # the training path: one chain per expert
    moe = hand_sized_moe()
    z = torch.randn(3, 32, dtype=torch.float64, requires_grad=True)  # rows 0-1 for expert 0, row 2 for expert 1
    R = torch.randn(3, 32, dtype=torch.float64)
    h = moe.experts_forward(z, [2, 1])
    (h * R).sum().backward()

    # By hand: each quantiser's derivative taken as 1, everything else the chain rule at the quantised values.
    q8, q4 = (lambda t: fake_quantize(t, FP8_E4M3)), (lambda t: fake_quantize(t, FP4_E2M1))
    rows = {0: slice(0, 2), 1: slice(2, 3)}
    for e, r in rows.items():
        ex = moe.experts[e]
        W1, W2, W3 = (q4(ex.w1.weight.detach()), q4(ex.w2.weight.detach()), q4(ex.w3.weight.detach()))
        zq = q8(z.detach()[r])
        g, u = (zq @ W1.T).requires_grad_(), (zq @ W3.T).requires_grad_()
        a = glu(g, u, *moe.act)
        aq = q8(a.detach())
        assert torch.equal(h.detach()[r], aq @ W2.T)  # the forward: the quantised chain, bitwise
        d_aq = R[r] @ W2  # dL/d(aq), passed straight through to a
        dg, du = torch.autograd.grad(a, (g, u), d_aq)
        torch.testing.assert_close(ex.w2.weight.grad, R[r].T @ aq, rtol=1e-13, atol=0)
        torch.testing.assert_close(ex.w1.weight.grad, dg.T @ zq, rtol=1e-13, atol=0)
        torch.testing.assert_close(ex.w3.weight.grad, du.T @ zq, rtol=1e-13, atol=0)
        torch.testing.assert_close(z.grad[r], dg @ W1 + du @ W3, rtol=1e-13, atol=0)
        assert not torch.equal(W1, ex.w1.weight)  # the quantisers did change the values used


def qat_model(vocab_size: int = 512) -> K3Model:
    """The tiny model in fp32 with QAT on and its weights as trained ones look (AttnRes queries, router bias)."""
    torch.manual_seed(0)
    model = K3Model(K3Config.from_preset("tiny", vocab_size=vocab_size, expert_quantization="mxfp4"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj" in name or "e_score_correction_bias" in name:
                p.normal_(std=0.3)
    return model


def test_gradients_reach_every_parameter_under_qat():
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    grads = {}
    for qat in (None, "mxfp4"):
        model = qat_model()  # the same initial weights both times
        set_expert_quantization(model, qat)
        model(ids, labels=ids).loss.backward()
        grads[qat] = {n: p.grad for n, p in model.named_parameters()}
    # The first layer's attention AttnRes has one source (the embeddings) to weigh: a softmax over one value,
    # whose parameters get no gradient in any model. Every other parameter gets one, with QAT as without.
    one_source = {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
    for gs in grads.values():
        assert {n for n, g in gs.items() if g is None or not g.abs().sum() > 0} == one_source
        assert all(torch.isfinite(g).all() for g in gs.values() if g is not None)
    experts = [n for n in grads[None] if ".experts." in n]
    assert len(experts) == 4 * 8 * 3  # every routed expert of every MoE layer got tokens and a gradient
    assert not any(torch.equal(grads["mxfp4"][n], grads[None][n]) for n in grads[None] if n not in one_source)


def test_qat_with_activation_checkpointing_is_bitwise_the_same():
    """The recomputed forward runs the quantisers again: they are deterministic, so loss and every gradient match."""
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(3))
    results = []
    for checkpointing in (False, True):
        model = qat_model()
        model.set_activation_checkpointing(checkpointing)
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (loss_ckpt, grads_ckpt) = results
    assert torch.equal(loss, loss_ckpt) and grads.keys() == grads_ckpt.keys()
    assert all(torch.equal(grads[n], grads_ckpt[n]) for n in grads)


def test_the_packed_export_computes_the_trained_function_bitwise(tmp_path):
    from k3.hub import load_pretrained
    from k3.hub.export import release_config, release_tensors, weights_dtype, write_model_folder

    model = qat_model().train()
    long_ids = torch.randint(0, 512, (2, 160), generator=torch.Generator().manual_seed(2))
    short_ids = long_ids[:, :45]
    trained = {ids.shape[1]: model(ids, labels=ids) for ids in (long_ids, short_ids)}  # grad on: the training forward
    tensors = release_tensors(model.state_dict(), model.config, quantize="mxfp4")
    folder = write_model_folder(
        tensors, release_config(model.config, "model", "mxfp4", None, weights_dtype(tensors)), tmp_path / "m"
    )
    assert json.loads((folder / "config.json").read_text())["k3"]["expert_quantization"] == "mxfp4"
    packed = load_pretrained(folder, quantization="mxfp4").model
    dense = load_pretrained(folder).model  # experts decoded to fp32 at load: the same function again
    assert packed.config.expert_quantization == "mxfp4"
    assert any(isinstance(m, MXFP4Linear) for m in packed.modules())
    with torch.no_grad():
        for served in (packed, dense):
            out = served(long_ids, labels=long_ids)
            assert torch.equal(out.logits, trained[160].logits) and torch.equal(out.loss, trained[160].loss)
            # AttnRes has one form in training and inference (k3.model.attn_res), so short inputs too
            assert torch.equal(served(short_ids).logits, trained[45].logits)
        plain = copy.deepcopy(packed)
        set_expert_quantization(plain, None)  # the same packed weights, inputs not MXFP8: not the same function
        assert not torch.equal(plain(long_ids).logits, trained[160].logits)


def engine_logits(model: K3Model, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[list[int]], int]:
    """(every lm_head output in order, greedy tokens per prompt, prompt tokens served from the prefix cache):
    the first prompt alone, then the others together (prefill chunks of 16 tokens and decodes in one step),
    so they hit the cache the first one filled."""
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    engine = LLMEngine(
        model, byte_tokenizer(), EngineConfig(num_pages=400, scheduler=SchedulerConfig(max_batched_tokens=16))
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens, cached = {}, 0
    for group in (prompts[:1], prompts[1:]):
        ids = [engine.add_request(prompt, params) for prompt in group]
        tokens.update({i: [] for i in ids})
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
                cached = max(cached, o.num_cached_tokens)
    hook.remove()
    return seen, list(tokens.values()), cached


def test_the_engine_serving_packed_experts_computes_the_trained_function_bitwise():
    vocab = byte_tokenizer().vocab_size
    trained = qat_model(vocab).eval()
    served = copy.deepcopy(trained)
    pack_experts(served)  # what loading the packed export gives (tested above); packed with the trained bytes
    base = list(range(40, 110))
    prompts = [base, [*base, 7, 8, 9], [*base[:50], 3]]  # the later two reuse the first one's prefix
    want, want_tokens, want_cached = engine_logits(trained, prompts)
    got, got_tokens, got_cached = engine_logits(served, prompts)
    assert got_cached == want_cached > 0  # the prefix cache was used
    assert got_tokens == want_tokens and len(got) == len(want)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with torch.no_grad():  # and the engine agrees with one uncached forward of the trained model
        ref = trained(torch.tensor([base + want_tokens[0]])).logits[0, len(base) - 1 : -1]
    assert [int(t) for t in ref.argmax(-1)] == want_tokens[0]


def test_k3_train_qat_from_a_full_precision_checkpoint(tmp_path, capsys):
    args = tiny_train_args(tmp_path)
    assert main([*args, "--out", str(tmp_path / "fp")]) == 0
    assert main([*args, "--out", str(tmp_path / "qat"), "--qat", "mxfp4", "--init-from", str(tmp_path / "fp")]) == 0
    flags = json.loads((tmp_path / "qat" / "run.json").read_text())["flags"]
    meta = json.loads((tmp_path / "qat" / "step_00000003" / "meta.json").read_text())
    assert flags["qat"] == "mxfp4" and meta["config"]["k3"]["expert_quantization"] == "mxfp4"
    assert "expert_quantization" not in json.loads((tmp_path / "fp" / "step_00000003" / "meta.json").read_text())[
        "config"
    ].get("k3", {})
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "bad"), "--qat", "fp8"]) != 0
    assert "--qat must be mxfp4 (or absent: full precision), got 'fp8'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_expert_widths_that_are_not_whole_blocks_are_refused():
    from k3.config import ConfigError

    with pytest.raises(ConfigError, match=r"widths are 48 \(latent\) and 32 \(hidden\); both must be multiples of 32"):
        K3Config.from_preset("tiny", routed_expert_hidden_size=48, expert_quantization="mxfp4")
    model = K3Model(K3Config.from_preset("tiny", routed_expert_hidden_size=48))  # unquantised: any width
    with pytest.raises(ConfigError, match="multiples of 32"):
        set_expert_quantization(model, "mxfp4")
    assert model.config.expert_quantization is None  # refused before anything changed
    with pytest.raises(ConfigError, match="must be None"):
        set_expert_quantization(model, "fp8")


def test_torchao_mx_quantiser_agrees_bit_for_bit():
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    from k3.quant import quantize_mx

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 1024, generator=g).to(dtype)
        x = x * torch.exp2(torch.randint(-40, 40, (64, 32, 1), generator=g).float()).expand(64, 32, 32).flatten(1)
        for fmt, elem in ((FP8_E4M3, torch.float8_e4m3fn), (FP4_E2M1, torch.float4_e2m1fn_x2)):
            scale, data = to_mx(x.to(dtype), elem, 32)
            codes, scales = quantize_mx(x.to(dtype), fmt)
            assert torch.equal(scale.view(torch.uint8).view(scales.shape), scales)
            if fmt is FP4_E2M1:
                assert torch.equal(data.view(torch.uint8), pack_mxfp4(x.to(dtype))[0])
            else:
                assert torch.equal(data.view(torch.uint8), codes)
            assert same_bits(to_dtype(data, scale, elem, 32, dtype), fake_quantize(x.to(dtype), fmt))
