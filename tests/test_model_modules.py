"""Each model component against its defining equation or a plain reference, in float64."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.config import K3Config
from k3.model import K3Model
from k3.model.attn_res import attn_res
from k3.model.cache import MLALayerCache
from k3.model.kda import KimiDeltaAttention, causal_conv
from k3.model.mla import GatedMLA
from k3.model.moe import LatentMoE
from k3.model.norm import RMSNorm
from k3.model.router import Router
from k3.model.situ import situ
from k3.ops.kda import kda_gate, l2norm, naive_recurrent_kda

TINY = K3Config.from_preset("tiny")


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """float64, every parameter random (zero-initialised ones too), so no term can hide."""
    gen = torch.Generator().manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return module


def test_rmsnorm():
    norm = randomized(RMSNorm(7, eps=1e-6))
    x = torch.randn(3, 7, dtype=torch.float64)
    assert torch.allclose(norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight)


def test_situ_equation_and_swiglu_near_zero():
    g, u = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    ref = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert torch.allclose(situ(g, u, 4.0, 25.0), ref)
    small_g, small_u = g * 1e-3, u * 1e-3
    assert torch.allclose(situ(small_g, small_u), F.silu(small_g) * small_u, rtol=1e-5)


@settings(max_examples=200, deadline=None)
@given(st.floats(-1e30, 1e30), st.floats(-1e30, 1e30))
def test_situ_is_bounded_by_beta1_beta2(g, u):
    y = situ(torch.tensor([g], dtype=torch.float64), torch.tensor([u], dtype=torch.float64), 4.0, 25.0)
    assert torch.isfinite(y).all() and y.abs().item() <= 100.0
    y16 = situ(torch.tensor([g]).bfloat16(), torch.tensor([u]).bfloat16())
    assert torch.isfinite(y16.float()).all()


def test_causal_conv_with_tail_equals_full_sequence():
    conv = randomized(torch.nn.Conv1d(6, 6, 4, groups=6, bias=False))
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    full, _ = causal_conv(x, conv.weight, None)
    ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, groups=6)).transpose(1, 2)
    assert torch.allclose(full, ref)
    a, tail = causal_conv(x[:, :7], conv.weight, None)
    b, _ = causal_conv(x[:, 7:], conv.weight, tail)
    assert torch.allclose(torch.cat([a, b], 1), full)


def test_kda_layer_matches_reference():
    layer = randomized(KimiDeltaAttention(TINY))
    x = torch.randn(2, 19, TINY.hidden_size, dtype=torch.float64)
    B, T, H, K = 2, 19, TINY.kda_num_heads, TINY.kda_head_dim

    def conv(proj, c):
        y = F.conv1d(F.pad(proj(x).transpose(1, 2), (3, 0)), c.weight, groups=c.weight.shape[0])
        return F.silu(y).transpose(1, 2).reshape(B, T, H, K)

    q, k, v = conv(layer.q_proj, layer.q_conv1d), conv(layer.k_proj, layer.k_conv1d), conv(layer.v_proj, layer.v_conv1d)
    g = kda_gate(layer.f_b_proj(layer.f_a_proj(x)).view(B, T, H, K), layer.A_log, layer.dt_bias, -5.0)
    o, _ = naive_recurrent_kda(l2norm(q), l2norm(k), v, g, torch.sigmoid(layer.b_proj(x)))
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + TINY.rms_norm_eps) * layer.o_norm.weight
    ref = layer.o_proj((o * torch.sigmoid(layer.g_proj(x).view(B, T, H, K))).reshape(B, T, H * K))
    assert torch.allclose(layer(x), ref, atol=1e-10)


def explicit_mla(layer: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Per-head softmax attention written out, from the spec's equations."""
    B, T, _ = x.shape
    c_q = layer.q_a_layernorm(layer.q_a_proj(x))
    q = layer.q_b_proj(c_q).view(B, T, layer.H, -1)
    kv = layer.kv_a_proj_with_mqa(x)
    c_kv, k_pe = layer.kv_a_layernorm(kv[..., : layer.rank]), kv[..., layer.rank :]
    kvb = layer.kv_b_proj(c_kv).view(B, T, layer.H, -1)
    heads = []
    for h in range(layer.H):
        k = torch.cat([kvb[:, :, h, : layer.nope], k_pe], -1)
        v = kvb[:, :, h, layer.nope :]
        s = q[:, :, h] @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(s, -1) @ v)
    o = torch.stack(heads, 2) * torch.sigmoid(layer.g_proj(x).view(B, T, layer.H, -1))
    return layer.o_proj(o.reshape(B, T, -1))


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_gate_init_follows_fla_per_gate_kind(lower_bound):
    """fla's KDA layer starts the bounded (safe) gate at A_log = 0 and the unbounded one at A ∈ [1, 16]; with
    the bounded gate at g_raw = 0 every channel then decays by lb·sigmoid(dt_bias) ≈ 5·dt, dt ∈ [1e-3, 0.1]."""
    torch.manual_seed(0)
    layer = KimiDeltaAttention(K3Config.from_preset("tiny", gate_lower_bound=lower_bound))
    layer.reset_gate_parameters()
    dt = F.softplus(layer.dt_bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    g0 = kda_gate(torch.zeros(1, 1, layer.H, layer.K), layer.A_log, layer.dt_bias, lower_bound)[0, 0]
    if lower_bound is None:
        A = layer.A_log.exp()
        assert A.min() >= 1 and A.max() <= 16 and A.max() > A.min()  # drawn per head, not one constant
        torch.testing.assert_close(g0, -A[:, None] * dt.view(layer.H, layer.K))
    else:
        assert torch.equal(layer.A_log, torch.zeros_like(layer.A_log))
        torch.testing.assert_close(g0, lower_bound * torch.sigmoid(layer.dt_bias).view(layer.H, layer.K))
        # forgetting from the first step: no channel saturated at g ≈ 0 (rate 16 gave g > -1e-4 in most)
        assert g0.max() < -4e-3 and g0.min() > -0.5


def test_mla_naive_and_absorbed_match_the_equations():
    layer = randomized(GatedMLA(TINY))
    x = torch.randn(2, 13, TINY.hidden_size, dtype=torch.float64)
    ref = explicit_mla(layer, x)
    assert torch.allclose(layer(x), ref, atol=1e-12)
    layer.impl = "absorbed"
    assert torch.allclose(layer(x), ref, atol=1e-12)


@pytest.mark.parametrize("impl", ["naive", "absorbed"])
def test_mla_cache_holds_only_latents(impl):
    layer = randomized(GatedMLA(TINY))
    layer.impl = impl
    x = torch.randn(1, 9, TINY.hidden_size, dtype=torch.float64)
    cache = MLALayerCache()
    out = torch.cat(
        [layer(x[:, :4], cache), layer(x[:, 4:7], cache), layer(x[:, 7:8], cache), layer(x[:, 8:], cache)], 1
    )
    assert torch.allclose(out, explicit_mla(layer, x), atol=1e-12)
    assert cache.latent.shape == (1, 9, TINY.kv_lora_rank) and cache.k_pe.shape == (1, 9, TINY.qk_rope_head_dim)


def test_router_bias_selects_but_does_not_weigh():
    router = randomized(Router(8, num_experts=6, top_k=2, renormalize=True, scale=2.5))
    router.e_score_correction_bias.zero_()
    x = torch.randn(20, 8, dtype=torch.float64)
    plain = router(x)
    scores = torch.sigmoid(x @ router.weight.t())
    assert torch.allclose(plain.scores_TE, scores)
    assert torch.equal(plain.experts_TK, scores.topk(2).indices)
    assert torch.allclose(plain.weights_TK.sum(-1), torch.full((20,), 2.5, dtype=torch.float64))
    router.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 10.0]))  # expert 5 always wins a slot
    biased = router(x)
    assert (biased.experts_TK == 5).any(-1).all()
    chosen = biased.scores_TE.gather(1, biased.experts_TK)
    assert torch.allclose(biased.weights_TK, 2.5 * chosen / chosen.sum(-1, keepdim=True))  # weights from s, not s + b
    third = (biased.scores_TE + router.e_score_correction_bias).sort(-1, descending=True).values[:, 2]
    assert torch.allclose(biased.cutoff_T, third)
    assert torch.allclose(biased.required_bias_TE(), third[:, None] - biased.scores_TE)
    assert torch.equal(biased.loads_E, torch.bincount(biased.experts_TK.flatten(), minlength=6))


@pytest.mark.parametrize("merge_elements", [1 << 18, 0])  # merged experts (few tokens), one chain each (many)
def test_latent_moe_matches_per_token_reference(merge_elements, monkeypatch):
    monkeypatch.setattr("k3.model.moe.MERGE_ELEMENTS", merge_elements)
    moe = randomized(LatentMoE(TINY))
    x = torch.randn(3, 7, TINY.hidden_size, dtype=torch.float64, requires_grad=True)
    y, r = moe(x)
    x_TD = x.reshape(-1, TINY.hidden_size)
    rows = []
    for t in range(x_TD.shape[0]):
        z = moe.routed_expert_down_proj(x_TD[t])
        u = sum(
            w * moe.experts[e].w2(situ(moe.experts[e].w1(z), moe.experts[e].w3(z)))
            for w, e in zip(r.weights_TK[t], r.experts_TK[t].tolist(), strict=True)
        )
        rows.append(moe.routed_expert_up_proj(moe.routed_expert_norm(u)) + moe.shared_experts(x_TD[t]))
    ref = torch.stack(rows)
    assert torch.allclose(y.reshape(-1, TINY.hidden_size), ref, atol=1e-12)
    # and the gradients, to the input and every expert weight, through either dispatch
    w = torch.randn_like(ref)
    params = [x, *moe.parameters()]
    got = torch.autograd.grad((y.reshape(-1, TINY.hidden_size) * w).sum(), params, allow_unused=True, retain_graph=True)
    want = torch.autograd.grad((ref * w).sum(), params, allow_unused=True)
    for g, h in zip(got, want, strict=True):
        assert (g is None and h is None) or torch.allclose(g, h, atol=1e-12)


def test_attn_res_zero_query_is_uniform_average():
    proj, norm = torch.nn.Linear(5, 1, bias=False).double(), RMSNorm(5).double()
    torch.nn.init.zeros_(proj.weight)
    sources = [torch.randn(2, 3, 5, dtype=torch.float64) * (i + 1) for i in range(4)]
    assert torch.allclose(attn_res(sources, proj, norm), torch.stack(sources).mean(0))


def test_attn_res_matches_the_equation():
    proj, norm = randomized(torch.nn.Linear(5, 1, bias=False)), randomized(RMSNorm(5))
    sources = [torch.randn(2, 3, 5, dtype=torch.float64) for _ in range(3)]
    logits = torch.stack([(norm(v) * proj.weight[0]).sum(-1) for v in sources])  # w · RMSNorm(v_n)
    ref = (torch.softmax(logits, 0)[..., None] * torch.stack(sources)).sum(0)
    assert torch.allclose(attn_res(sources, proj, norm), ref)


def test_checkpoint_parameter_names():
    names = set(K3Model(TINY).state_dict())
    expected = {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.output_attn_res_proj.weight",
        "model.output_attn_res_norm.weight",
        "lm_head.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.f_a_proj.weight",
        "model.layers.0.self_attn.q_conv1d.weight",
        "model.layers.0.self_attn.A_log",
        "model.layers.0.self_attention_res_proj.weight",
        "model.layers.0.mlp_res_norm.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.3.self_attn.q_a_layernorm.weight",
        "model.layers.3.self_attn.g_proj.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
        "model.layers.1.block_sparse_moe.experts.7.w2.weight",
        "model.layers.1.block_sparse_moe.routed_expert_norm.weight",
        "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight",
    }
    assert expected <= names


def test_standard_residual_ablation_has_no_attnres():
    model = K3Model(K3Config.from_preset("tiny", residual="standard"))
    assert not any("_res_" in n for n in model.state_dict())
    assert model(torch.randint(0, 512, (1, 9))).logits.shape == (1, 9, 512)
