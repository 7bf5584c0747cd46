"""The routed experts' optimiser options (--expert-optimizer muon | muon-active | adamw, --expert-ns-steps): each
update rule on hand-sized weights, the groups build_optimizer makes, and the trainer recording the option."""

import json
from pathlib import Path

import pytest
import torch

from k3 import K3Config, K3Model
from k3.formats.run_record import RunMismatchError
from k3.model.moe import LatentMoE
from k3.train.muon import MuonAdamW, muon_update
from k3.train.optim import build_optimizer, routed_expert_weights

LR, WD, MU = 0.1, 0.5, 0.95


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def two_experts(skip_idle: bool) -> tuple[torch.nn.Parameter, torch.nn.Parameter, MuonAdamW]:
    a, b = torch.nn.Parameter(randn(4, 3, seed=1)), torch.nn.Parameter(randn(4, 3, seed=2))
    opt = MuonAdamW([dict(algo="muon", params=[a, b], lr=LR, weight_decay=WD, skip_idle=skip_idle)])
    return a, b, opt


def muon_step(w: torch.Tensor, buf: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented Muon rule, by hand: (new weight, new momentum)."""
    buf = MU * buf + g
    return w * (1 - LR * WD) - LR * muon_update(g + MU * buf), buf


@pytest.mark.parametrize("idle_grad", ["none", "zeros"])
def test_muon_active_only_decays_an_expert_without_gradient(idle_grad):
    a, b, opt = two_experts(skip_idle=True)
    ga1, gb1, ga2 = randn(4, 3, seed=3), randn(4, 3, seed=4), randn(4, 3, seed=5)
    a.grad, b.grad = ga1.clone(), gb1.clone()
    a0, b0 = a.detach().clone(), b.detach().clone()
    opt.step()  # both active: plain Muon
    want_a, buf_a = muon_step(a0, torch.zeros(4, 3, dtype=torch.float64), ga1)
    want_b, buf_b = muon_step(b0, torch.zeros(4, 3, dtype=torch.float64), gb1)
    torch.testing.assert_close(a.detach(), want_a, rtol=0, atol=1e-12)
    torch.testing.assert_close(b.detach(), want_b, rtol=0, atol=1e-12)

    a.grad, b.grad = ga2.clone(), None if idle_grad == "none" else torch.zeros(4, 3, dtype=torch.float64)
    a1, b1 = a.detach().clone(), b.detach().clone()
    opt.step()  # b idle: momentum B <- mu*B, weight W <- W(1 - lr*wd), no orthogonal step
    want_a, _ = muon_step(a1, buf_a, ga2)
    torch.testing.assert_close(a.detach(), want_a, rtol=0, atol=1e-12)
    torch.testing.assert_close(b.detach(), b1 * (1 - LR * WD), rtol=0, atol=1e-15)
    torch.testing.assert_close(opt.state[b]["momentum_buffer"], MU * buf_b, rtol=0, atol=1e-15)

    # its next active step uses the decayed momentum: B = mu*(mu*B1) + G
    gb3 = randn(4, 3, seed=6)
    a.grad, b.grad = None, gb3.clone()
    b2 = b.detach().clone()
    opt.step()
    want_b, _ = muon_step(b2, MU * buf_b, gb3)
    torch.testing.assert_close(b.detach(), want_b, rtol=0, atol=1e-12)


def test_plain_muon_leaves_a_none_gradient_alone_and_steps_along_momentum_on_a_zero_one():
    """Today's rule, which muon-active changes: grad None untouched; an all-zero grad still gets NS(mu^2 B)."""
    a, b, opt = two_experts(skip_idle=False)
    a.grad, b.grad = randn(4, 3, seed=3), randn(4, 3, seed=4)
    opt.step()
    a1, b1 = a.detach().clone(), b.detach().clone()
    buf_b = opt.state[b]["momentum_buffer"].clone()
    a.grad, b.grad = None, torch.zeros(4, 3, dtype=torch.float64)
    opt.step()
    assert torch.equal(a.detach(), a1)
    want_b, _ = muon_step(b1, buf_b, torch.zeros(4, 3, dtype=torch.float64))
    torch.testing.assert_close(b.detach(), want_b, rtol=0, atol=1e-12)
    assert (b.detach() - b1 * (1 - LR * WD)).abs().max() > 1e-3  # a full-size step along stale momentum


def tiny_model() -> K3Model:
    torch.manual_seed(0)
    return K3Model(K3Config.from_preset("tiny")).double()


def groups_by_name(opt: MuonAdamW) -> dict[str, dict]:
    return {g["name"]: g for g in opt.param_groups}


def test_default_keeps_the_experts_in_the_muon_group():
    model = tiny_model()
    experts = routed_expert_weights(model)
    moe_layers = sum(isinstance(m, LatentMoE) for m in model.modules())
    assert moe_layers and len(experts) == 3 * model.config.num_experts * moe_layers
    assert all(".experts." in n and n.endswith(("w1.weight", "w2.weight", "w3.weight")) for n in experts)
    opt = build_optimizer(model)
    assert "muon_experts" not in groups_by_name(opt)
    muon_names = set(groups_by_name(opt)["muon"]["param_names"])
    assert experts <= muon_names
    assert build_optimizer(model, expert_ns_steps=5).param_groups[-1]["name"] == "muon"  # same as the default


@pytest.mark.parametrize("option, ns", [("muon", 3), ("muon-active", 5), ("adamw", 5)])
def test_each_option_puts_exactly_the_routed_experts_in_their_own_group(option, ns):
    model = tiny_model()
    experts = routed_expert_weights(model)
    default = groups_by_name(build_optimizer(model))
    groups = groups_by_name(build_optimizer(model, expert_optimizer=option, expert_ns_steps=ns))
    own = groups[f"{'adamw' if option == 'adamw' else 'muon'}_experts"]
    assert set(own["param_names"]) == experts
    assert own["weight_decay"] == 0.1
    if option == "adamw":
        assert own["algo"] == "adamw" and own["betas"] == (0.9, 0.95)
    else:
        assert (own["algo"], own["ns_steps"], own["skip_idle"]) == ("muon", ns, option == "muon-active")
    assert set(groups["muon"]["param_names"]) == set(default["muon"]["param_names"]) - experts
    per_head = [n for n in default if n.startswith("muon_per_head")]
    assert per_head and all(groups[n]["param_names"] == default[n]["param_names"] for n in per_head)  # SPEC Q/K/V


def test_expert_ns_steps_is_what_the_experts_step_uses():
    model = tiny_model()
    name = sorted(routed_expert_weights(model))[0]
    w = dict(model.named_parameters())[name]
    opt = build_optimizer(model, lr=LR, weight_decay=WD, expert_ns_steps=3)
    g = randn(*w.shape, seed=7)
    w0 = w.detach().clone()
    w.grad = g.clone()
    opt.step()
    want = w0 * (1 - LR * WD) - LR * muon_update(g + MU * g, ns_steps=3)
    torch.testing.assert_close(w.detach(), want, rtol=0, atol=1e-12)
    assert (want - (w0 * (1 - LR * WD) - LR * muon_update(g + MU * g, ns_steps=5))).abs().max() > 1e-4


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="expert_optimizer must be one of muon, muon-active, adamw, got 'sgd'"):
        build_optimizer(tiny_model(), expert_optimizer="sgd")
    with pytest.raises(ValueError, match="expert_ns_steps must be at least 1, got 0"):
        build_optimizer(tiny_model(), expert_ns_steps=0)


@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(40):
        body = "".join(f"    value_{j} = compute({i}, {j})\n" for j in range(i % 5 + 3))
        (root / f"module_{i:03d}.py").write_text(f"def function_{i}(x):\n{body}    return x\n")
    return root


def test_trainer_records_the_option_and_resume_refuses_a_changed_one_without_override(tmp_path, corpus):
    from k3.train.trainer import TrainArgs, Trainer

    def args(**kw) -> TrainArgs:
        return TrainArgs(
            **{
                **dict(
                    out=str(tmp_path / "run"),
                    preset="tiny",
                    steps=2,
                    batch_size=2,
                    seq_len=16,
                    vocab_size=300,
                    eval_every=100,
                    eval_batches=1,
                    warmup=1,
                    data=str(corpus),
                    progress=False,
                ),
                **kw,
            }
        )

    Trainer(args(expert_optimizer="muon-active", expert_ns_steps=3), log=lambda *a: None).train()
    flags = json.loads((tmp_path / "run" / "run.json").read_text())["flags"]
    assert (flags["expert_optimizer"], flags["expert_ns_steps"]) == ("muon-active", 3)

    with pytest.raises(RunMismatchError, match=r"--expert-optimizer: the run recorded 'muon-active', now 'adamw'"):
        Trainer(args(steps=3, resume=True, expert_optimizer="adamw", expert_ns_steps=3), log=lambda *a: None)
    with pytest.raises(RunMismatchError, match=r"--expert-ns-steps: the run recorded 3, now 5"):
        Trainer(args(steps=3, resume=True, expert_optimizer="muon-active"), log=lambda *a: None)

    logged = []
    trainer = Trainer(
        args(steps=3, resume=True, override=True, expert_optimizer="adamw", expert_ns_steps=3), log=logged.append
    )
    experts = routed_expert_weights(trainer.model)
    params = dict(trainer.model.named_parameters())
    assert groups_by_name(trainer.optimizer)["adamw_experts"]["algo"] == "adamw"
    assert all(not trainer.optimizer.state[params[n]] for n in experts)  # AdamW moments start from zero
    kept = set(groups_by_name(trainer.optimizer)["muon"]["param_names"])
    assert kept and all("momentum_buffer" in trainer.optimizer.state[params[n]] for n in kept)
    assert any("optimiser state carried over" in line and f"{len(experts)} parameters" in line for line in logged)
    trainer.train()
    assert all("exp_avg" in trainer.optimizer.state[params[n]] for n in experts)
    flags = json.loads((tmp_path / "run" / "run.json").read_text())["flags"]
    assert flags["expert_optimizer"] == "adamw"
