"""MuonAdamW (SPEC §2.7): Newton–Schulz against its scalar map, per-head blocks, the RMS match, decoupled
decay, AdamW against torch's, the state_dict round trip through safetensors, parameter groups by name, lr."""

import itertools
import json
import math

import pytest
import torch
from torch import nn

from k3 import K3Config, K3Model
from k3.train import muon
from k3.train.muon import NS_COEFFS, MuonAdamW, muon_update, newton_schulz
from k3.train.optim import (
    ParamGroupError,
    build_optimizer,
    check_groups,
    hyperparameters_kept,
    lr_at,
    param_groups,
    set_lr_factor,
)

WIDE_AND_TALL = [(16, 64), (64, 16), (32, 128), (128, 32), (3, 50), (50, 3), (64, 96), (96, 64)]


def ns_scalar(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """What Newton–Schulz does to each singular value: σ ← aσ + bσ³ + cσ⁵."""
    a, b, c = NS_COEFFS
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


# After 5 steps every normalised singular value σ/‖G‖_F in [0.01, 1] lands in [0.6818, 1.1344] (the band the
# quintic oscillates in instead of converging to 1; below σ/‖G‖_F ≈ 0.0015, 5 steps cannot lift σ that
# far), and nothing in [0, 1] ends above 1.2024. test_scalar_map_band checks these numbers.
BAND = (0.68, 1.135)
CEILING = 1.21


def randn(*shape: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_scalar_map_band():
    y = ns_scalar(torch.linspace(0.01, 1, 400_001, dtype=torch.float64))
    assert BAND[0] < y.min() < BAND[0] + 0.01 and BAND[1] - 0.01 < y.max() < BAND[1]
    assert ns_scalar(torch.linspace(0, 1, 200_001, dtype=torch.float64)).max() < CEILING


@pytest.mark.parametrize("shape", [(24, 24), *WIDE_AND_TALL])
def test_newton_schulz_acts_on_singular_values(shape):
    """NS(G) = U·p⁵(Σ/‖G‖_F)·Vᵀ: the output's singular values are the scalar map of the input's, in fp64."""
    G = randn(*shape, dtype=torch.float64)
    sv_in = torch.linalg.svdvals(G) / (torch.linalg.matrix_norm(G) + 1e-7)
    expected = ns_scalar(sv_in).sort().values
    got = torch.linalg.svdvals(newton_schulz(G)).sort().values
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("shape", WIDE_AND_TALL)
def test_newton_schulz_close_to_orthogonal(shape):
    for seed in range(5):
        G = randn(*shape, seed=seed)
        # the band's precondition: no singular value tiny next to ‖G‖_F (true for non-square Gaussians)
        assert (torch.linalg.svdvals(G).min() / torch.linalg.matrix_norm(G)) > 0.01
        out = newton_schulz(G)
        assert out.dtype == torch.float32 and out.shape == G.shape
        S = torch.linalg.svdvals(out)
        assert BAND[0] < S.min() and S.max() < BAND[1], (shape, S.min().item(), S.max().item())


def test_newton_schulz_square():
    """Square Gaussians have singular values near 0 that 5 steps cannot lift; the bulk is still in the band."""
    for seed in range(5):
        S = torch.linalg.svdvals(newton_schulz(randn(64, 64, seed=seed)))
        assert S.max() < CEILING
        assert ((BAND[0] < S) & (BAND[1] > S)).float().mean() > 0.9


def test_newton_schulz_batched_and_dtypes():
    G = randn(2, 3, 16, 40)
    batched = newton_schulz(G)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(batched[i, j], newton_schulz(G[i, j]), rtol=1e-5, atol=1e-6)
    assert newton_schulz(G.bfloat16()).dtype == torch.bfloat16
    assert newton_schulz(G.double()).dtype == torch.float64


@pytest.mark.parametrize("shape", WIDE_AND_TALL)
def test_newton_schulz_in_bfloat16_stays_in_the_band(shape):
    """Iterations in bf16 (Muon's reference does this): the fp32 band of singular values widened by bf16's
    rounding over the iterations (±0.02), and within a few percent of the fp32 result; the result comes back
    in G's dtype."""
    for seed in range(3):
        G = randn(*shape, seed=seed)
        out = newton_schulz(G, dtype=torch.bfloat16)
        assert out.dtype == torch.float32 and out.shape == G.shape
        S = torch.linalg.svdvals(out)
        assert BAND[0] - 0.02 < S.min() and S.max() < BAND[1] + 0.02, (shape, S.min().item(), S.max().item())
        fp32 = newton_schulz(G)
        assert ((out - fp32).norm() / fp32.norm()) < 0.06
    G = randn(20, 30, dtype=torch.float64)
    assert torch.equal(newton_schulz(G, dtype=torch.bfloat16), newton_schulz(G))  # fp64 stays fp64


def test_muon_ns_dtype_group_key():
    """ns_dtype "bfloat16" gives nearly the fp32 step; a bad name is refused; a state_dict from before the key
    existed loads with the default, and hyperparameters_kept keeps the value the flags give now."""
    w, g = randn(24, 40, seed=1), randn(24, 40, seed=2)
    fp32, bf16 = one_step(w, g), one_step(w, g, ns_dtype="bfloat16")
    step32, step16 = (w - fp32).flatten(), (w - bf16).flatten()
    assert torch.nn.functional.cosine_similarity(step32, step16, dim=0) > 0.999
    assert not torch.equal(fp32, bf16)
    with pytest.raises(ValueError, match="ns_dtype must be one of float32, bfloat16, got 'fp8'"):
        one_step(w, g, ns_dtype="fp8")
    p = nn.Parameter(w.clone())
    old = MuonAdamW([dict(params=[p], algo="muon")]).state_dict()
    del old["param_groups"][0]["ns_dtype"]
    opt = MuonAdamW([dict(params=[p], algo="muon", ns_dtype="bfloat16")])
    with hyperparameters_kept(opt):
        opt.load_state_dict(old)
    assert opt.param_groups[0]["ns_dtype"] == "bfloat16"
    fresh = MuonAdamW([dict(params=[p], algo="muon")])
    fresh.load_state_dict(old)
    assert fresh.param_groups[0]["ns_dtype"] == "float32"


def one_step(weight: torch.Tensor, grad: torch.Tensor, **group) -> torch.Tensor:
    """The parameter after one optimiser step from a fresh state."""
    p = nn.Parameter(weight.clone())
    p.grad = grad.clone()
    algo = group.pop("algo", "muon")
    MuonAdamW([dict(params=[p], algo=algo, **group)]).step()
    return p.detach()


def test_per_head_blocks_are_independent():
    H, r, c = 3, 8, 24
    W, G = randn(H * r, c, seed=1), randn(H * r, c, seed=2)
    G2 = G.clone()
    G2[2 * r :] = randn(r, c, seed=3)  # only head 2's gradient changes
    a = one_step(W, G, heads=H, lr=0.1).view(H, r, c)
    b = one_step(W, G2, heads=H, lr=0.1).view(H, r, c)
    assert torch.equal(a[:2], b[:2])
    assert not torch.allclose(a[2], b[2])
    # each block is its own orthogonalisation, scaled by 0.2·√max(r, c); the whole-matrix update differs
    D = 1.95 * G  # the Nesterov direction from zero momentum: g + μ·(μ·0 + g)
    for h in range(H):
        expected = W[h * r : (h + 1) * r] - 0.1 * 0.2 * math.sqrt(c) * newton_schulz(D[h * r : (h + 1) * r])
        torch.testing.assert_close(a[h], expected, rtol=1e-5, atol=1e-6)
    whole = one_step(W, G, heads=1, lr=0.1).view(H, r, c)
    assert (whole - a).abs().max() > 1e-2


def test_same_shaped_params_batched_as_if_alone(monkeypatch):
    """The optimiser stacks same-shaped matrices into batched calls (in chunks); each still gets its own update."""
    monkeypatch.setitem(muon.NS_BATCH_ELEMENTS, "cpu", 2 * 12 * 20)  # two matrices per call: chunks 2 + 1
    W, G = randn(3, 12, 20, seed=1), randn(3, 12, 20, seed=2)
    params = [nn.Parameter(w.clone()) for w in W]
    for p, g in zip(params, G, strict=True):
        p.grad = g.clone()
    MuonAdamW([dict(params=params, algo="muon", heads=2, lr=0.1, weight_decay=0.1)]).step()
    for p, w, g in zip(params, W, G, strict=True):
        torch.testing.assert_close(p.detach(), one_step(w, g, heads=2, lr=0.1, weight_decay=0.1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 64), (32, 128), (128, 32), (2, 64)])
def test_muon_update_rms_matches_adamw(shape):
    """RMS(update) = 0.2·RMS(singular values of NS(D)) ∈ 0.2·BAND: about AdamW's 0.2, before lr."""
    W = randn(*shape, seed=1)
    update = W - one_step(W, randn(*shape, seed=2), lr=1.0)
    rms = update.pow(2).mean().sqrt().item()
    assert 0.2 * BAND[0] < rms < 0.2 * BAND[1]


@pytest.mark.parametrize("algo", ["muon", "adamw"])
def test_weight_decay_is_decoupled(algo):
    lr, wd = 0.05, 0.3
    W, G = randn(16, 32, seed=1), randn(16, 32, seed=2)
    # zero gradient: only the decay acts, p ← p·(1 − lr·wd)
    assert torch.equal(one_step(W, torch.zeros_like(W), algo=algo, lr=lr, weight_decay=wd), W * (1 - lr * wd))
    # with a gradient the decay is added on top of the same update, never fed through momentum or moments
    decayed = one_step(W, G, algo=algo, lr=lr, weight_decay=wd)
    plain = one_step(W, G, algo=algo, lr=lr, weight_decay=0.0)
    torch.testing.assert_close(decayed - plain, -lr * wd * W, rtol=1e-4, atol=1e-6)


def test_adamw_groups_match_torch():
    shapes = [(8, 12), (12,), (3, 4, 5)]
    ours = [nn.Parameter(randn(*s, seed=i)) for i, s in enumerate(shapes)]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=3e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    opt = MuonAdamW([dict(params=ours, algo="adamw")], **kw)
    torch_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    for step in range(4):
        for i, (p, q) in enumerate(zip(ours, ref, strict=True)):
            p.grad = randn(*p.shape, seed=100 * step + i)
            q.grad = p.grad.clone()
        opt.step()
        torch_opt.step()
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"])


def test_params_without_grad_are_skipped():
    p, q = nn.Parameter(randn(4, 6)), nn.Parameter(randn(6))
    before = p.detach().clone(), q.detach().clone()
    opt = MuonAdamW([dict(params=[p], algo="muon"), dict(params=[q], algo="adamw")], weight_decay=0.1)
    opt.step()
    assert torch.equal(p, before[0]) and torch.equal(q, before[1])  # not even decayed
    assert not opt.state


def test_group_validation():
    with pytest.raises(ValueError, match="algo"):
        MuonAdamW([dict(params=[nn.Parameter(randn(4, 4))])])
    with pytest.raises(ValueError, match="2-D"):
        MuonAdamW([dict(params=[nn.Parameter(randn(4))], algo="muon")])
    with pytest.raises(ValueError, match="heads=3"):
        MuonAdamW([dict(params=[nn.Parameter(randn(4, 4))], algo="muon", heads=3)])


TINY = K3Config.from_preset("tiny", num_attention_heads=4)  # MLA heads ≠ KDA heads (2), to tell them apart


def tiny_model(**overrides) -> K3Model:
    torch.manual_seed(0)
    return K3Model(K3Config.from_preset("tiny", num_attention_heads=4, **overrides))


def set_random_grads(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def placement(groups) -> dict[str, tuple]:
    """name -> (algo, heads, decayed) from param_groups' output."""
    out = {}
    for g in groups:
        for name, _ in g["params"]:
            assert name not in out
            out[name] = (g["algo"], g.get("heads"), g["weight_decay"] > 0)
    return out


def test_every_parameter_lands_where_the_spec_says():
    model = tiny_model()
    assert TINY.layer_types[:4] == ("kda", "kda", "kda", "mla") and TINY.ffn_types[:2] == ("dense", "moe")
    got = placement(param_groups(model, lr=1e-3, weight_decay=0.1))
    assert set(got) == {n for n, _ in model.named_parameters()}
    kda, mla, H_kda, H_mla = "model.layers.0.self_attn", "model.layers.3.self_attn", 2, 4
    muon, adamw, no_decay = ("muon", 1, True), ("adamw", None, True), ("adamw", None, False)
    expected = {
        f"{kda}.q_proj.weight": ("muon", H_kda, True),
        f"{kda}.k_proj.weight": ("muon", H_kda, True),
        f"{kda}.v_proj.weight": ("muon", H_kda, True),
        f"{mla}.q_b_proj.weight": ("muon", H_mla, True),
        f"{mla}.kv_b_proj.weight": ("muon", H_mla, True),
        f"{kda}.o_proj.weight": muon,
        f"{kda}.g_proj.weight": muon,
        f"{kda}.f_a_proj.weight": muon,
        f"{kda}.f_b_proj.weight": muon,
        f"{kda}.b_proj.weight": muon,
        f"{mla}.q_a_proj.weight": muon,
        f"{mla}.kv_a_proj_with_mqa.weight": muon,
        f"{mla}.g_proj.weight": muon,
        f"{mla}.o_proj.weight": muon,
        "model.layers.0.mlp.gate_proj.weight": muon,
        "model.layers.0.mlp.down_proj.weight": muon,
        "model.layers.1.block_sparse_moe.gate.weight": muon,
        "model.layers.1.block_sparse_moe.experts.3.w1.weight": muon,
        "model.layers.1.block_sparse_moe.experts.3.w2.weight": muon,
        "model.layers.1.block_sparse_moe.experts.7.w3.weight": muon,
        "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight": muon,
        "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight": muon,
        "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight": muon,
        "model.embed_tokens.weight": adamw,
        "lm_head.weight": adamw,
        "model.norm.weight": no_decay,
        "model.layers.0.input_layernorm.weight": no_decay,
        "model.layers.0.post_attention_layernorm.weight": no_decay,
        f"{kda}.o_norm.weight": no_decay,
        f"{mla}.q_a_layernorm.weight": no_decay,
        f"{mla}.kv_a_layernorm.weight": no_decay,
        "model.layers.1.block_sparse_moe.routed_expert_norm.weight": no_decay,
        f"{kda}.A_log": no_decay,
        f"{kda}.dt_bias": no_decay,
        f"{kda}.q_conv1d.weight": no_decay,
        f"{kda}.v_conv1d.weight": no_decay,
        "model.layers.0.self_attention_res_proj.weight": no_decay,
        "model.layers.2.mlp_res_proj.weight": no_decay,
        "model.layers.2.mlp_res_norm.weight": no_decay,
        "model.output_attn_res_proj.weight": no_decay,
        "model.output_attn_res_norm.weight": no_decay,
    }
    assert {n: got[n] for n in expected} == expected
    # the rule, not just the samples: per-head Muon only on the Q, K, V projections; Muon only on matrices
    per_head = {n for n, (algo, heads, _) in got.items() if algo == "muon" and heads != 1}
    assert per_head == {
        n for n in got if n.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj")
    }
    params = dict(model.named_parameters())
    assert all(params[n].ndim == 2 for n, (algo, _, _) in got.items() if algo == "muon")


def test_mla_plain_q_proj_and_low_rank_gate():
    got = placement(param_groups(tiny_model(q_lora_rank=None, use_full_rank_gate=False), 1e-3, 0.1))
    assert got["model.layers.3.self_attn.q_proj.weight"] == ("muon", 4, True)
    assert got["model.layers.0.self_attn.q_proj.weight"] == ("muon", 2, True)
    assert got["model.layers.0.self_attn.g_a_proj.weight"] == ("muon", 1, True)
    assert got["model.layers.0.self_attn.g_b_proj.weight"] == ("muon", 1, True)


def test_check_groups_catches_duplicates_and_gaps():
    model = tiny_model()
    groups = param_groups(model, 1e-3, 0.1)
    check_groups(model, groups)
    twice = [*groups, dict(name="extra", algo="adamw", params=[groups[0]["params"][0]])]
    with pytest.raises(ParamGroupError, match="two parameter groups"):
        check_groups(model, twice)
    with pytest.raises(ParamGroupError, match="in no group"):
        check_groups(model, groups[1:])


def test_state_dict_round_trip_through_safetensors_is_bitwise():
    """Resume from a checkpoint holding only tensors (safetensors) and JSON: identical parameters after."""
    save, load = pytest.importorskip("safetensors.torch").save, pytest.importorskip("safetensors.torch").load
    a = tiny_model()
    opt_a = build_optimizer(a, lr=1e-2, weight_decay=0.1)
    for step in range(2):
        set_random_grads(a, step)
        opt_a.step()

    sd = opt_a.state_dict()
    assert all(isinstance(v, torch.Tensor) for s in sd["state"].values() for v in s.values())
    assert all(s["step"].dtype == torch.float32 and s["step"].ndim == 0 for s in sd["state"].values() if "step" in s)
    tensors = {f"{i}.{k}": v for i, s in sd["state"].items() for k, v in s.items()}
    blob, groups_json = save(tensors), json.dumps(sd["param_groups"])

    b = tiny_model()
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, lr=1e-2, weight_decay=0.1)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in load(blob).items():
        i, k = key.split(".", 1)
        state.setdefault(int(i), {})[k] = v
    opt_b.load_state_dict({"state": state, "param_groups": json.loads(groups_json)})

    for step in range(2, 5):
        set_random_grads(a, step)
        set_random_grads(b, step)
        set_lr_factor(opt_a, 0.5)
        set_lr_factor(opt_b, 0.5)
        opt_a.step()
        opt_b.step()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_few_steps_lower_the_loss():
    model = tiny_model()
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    x = torch.randint(0, TINY.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        loss = model(x, labels=x).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert losses[-1] < losses[0] - 0.1


def test_lr_at_cosine():
    total, warmup = 100, 10
    assert lr_at(0, total, warmup) == pytest.approx(0.1)  # the first step already learns
    assert lr_at(warmup - 1, total, warmup) == 1.0  # the peak
    f = [lr_at(s, total, warmup) for s in range(total)]
    assert all(x > y for x, y in itertools.pairwise(f[warmup - 1 :]))  # decays monotonically
    assert f[warmup + (total - warmup) // 2 - 1] == pytest.approx(0.55)  # half way: the mean of peak and floor
    assert f[-1] == pytest.approx(0.1) and lr_at(total + 5, total, warmup) == pytest.approx(0.1)
    assert lr_at(99, 100, 0, min_ratio=0.0) == pytest.approx(0.0, abs=1e-12)


def test_lr_at_wsd():
    total, warmup = 100, 5
    f = [lr_at(s, total, warmup, schedule="wsd", min_ratio=0.2) for s in range(total)]
    assert f[0] == pytest.approx(0.2) and f[warmup - 1] == 1.0
    assert all(x == 1.0 for x in f[warmup:80])  # the stable plateau, up to the last 20 steps
    assert f[80] < 1.0 and f[-1] == pytest.approx(0.2)
    assert all(x - y == pytest.approx(0.8 / 20) for x, y in itertools.pairwise(f[79:]))  # linear
    with pytest.raises(ValueError, match="schedule"):
        lr_at(0, 10, 1, schedule="step")
    with pytest.raises(ValueError, match="warmup"):
        lr_at(0, 10, 11)


def test_set_lr_factor_scales_each_groups_base_lr():
    p, q = nn.Parameter(randn(4, 4)), nn.Parameter(randn(4))
    opt = MuonAdamW([dict(params=[p], algo="muon", lr=0.02), dict(params=[q], algo="adamw", lr=0.001)])
    set_lr_factor(opt, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.0005]
    assert [g["base_lr"] for g in opt.param_groups] == [0.02, 0.001]


def test_muon_second_step_is_nesterov_exactly():
    """Two steps pinned value for value: the first cannot tell Nesterov from plain momentum (the buffer
    starts at zero and Newton–Schulz normalises), the second can. Per-head blocks and decoupled decay too."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.float64))
    lr, wd, mu = 0.1, 0.01, 0.95
    opt = MuonAdamW([{"params": [p], "algo": "muon", "heads": 2}], lr=lr, weight_decay=wd, momentum=mu)
    g1, g2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    start = p.detach().clone()
    expected = start.clone()
    buf = torch.zeros_like(expected)
    for grad in (g1, g2):
        p.grad = grad.clone()
        opt.step()
        buf = mu * buf + grad
        direction = grad + mu * buf  # Nesterov: the gradient plus the momentum it is about to join
        expected = expected * (1 - lr * wd) - lr * muon_update(direction, heads=2)
        assert torch.allclose(p.detach(), expected, rtol=0, atol=1e-12)
    # the same two steps with plain momentum (direction = buffer) land measurably elsewhere
    plain = start * (1 - lr * wd) - lr * muon_update(g1, heads=2)
    plain = plain * (1 - lr * wd) - lr * muon_update(mu * g1 + g2, heads=2)
    assert (plain - expected).abs().max() > 1e-3
