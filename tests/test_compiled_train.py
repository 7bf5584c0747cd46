"""The training step compiled (k3.train.compiled) against the eager model, its reference: the loss and every
gradient equal in float64 through one graph with no breaks; the routed experts' operators and their hand-written
backward against autograd through the module's dispatch; the gated activation's backward; the errors of
`--compile` and `--dtype`."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from k3.model.moe import combine, moe_experts, moe_experts_backward, run_experts
from k3.model.situ import glu, glu_backward, glu_parts, situ_reference
from k3.train.compiled import IdleExperts, compile_blocker, compile_training
from k3.train.distributed import KILL_ENV
from tiny_models import loss_and_grads, tiny_model

ACTS = [("situ", 4.0, 25.0), ("silu", 1.0, 1.0)]


def routed_weights(E: int, L: int, I: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((I, L), (I, L), (L, I))
    return [
        [(torch.randn(s, generator=g, dtype=torch.float64) / L**0.5).requires_grad_() for _ in range(E)] for s in shapes
    ]


@pytest.mark.parametrize("act", ACTS, ids=[a[0] for a in ACTS])
def test_moe_experts_backward_equals_autograd_through_the_dispatch(act):
    """Odd sizes; expert 3 gets no token (its gradients must be zeros) and expert 0 gets most."""
    T, K, E, L, I = 23, 3, 6, 7, 11
    g = torch.Generator().manual_seed(1)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    experts[experts == 3] = 0
    experts[:, 0] = torch.where((experts[:, 1:] == 0).any(1), experts[:, 0], torch.zeros_like(experts[:, 0]))
    assert (experts.flatten() == 3).sum() == 0
    weights = torch.rand(T, K, generator=g, dtype=torch.float64).requires_grad_()
    z = torch.randn(T, L, generator=g, dtype=torch.float64).requires_grad_()
    w1, w3, w2 = routed_weights(E, L, I, 2)
    du = torch.randn(T, L, generator=g, dtype=torch.float64)
    inputs = [z, weights, *w1, *w3, *w2]

    u = moe_experts(z, experts, weights, w1, w3, w2, *act)
    counts = torch.bincount(experts.flatten(), minlength=E).tolist()
    active = [e for e in range(E) if counts[e]]

    def forward(z_AL, counts):
        parts = [(w1[e], w3[e], w2[e]) for e in active]
        return run_experts(z_AL, [counts[e] for e in active], parts, act, lambda x: x)

    reference = combine(z, experts, weights, counts, forward)
    torch.testing.assert_close(u, reference, rtol=1e-12, atol=1e-13)
    got = torch.autograd.grad(u, inputs, du)
    want = torch.autograd.grad(reference, inputs, du, allow_unused=True)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-11, atol=1e-12, msg=str(i))
    assert got[2 + 3].abs().sum() == 0 and got[2 + E + 3].abs().sum() == 0 and got[2 + 2 * E + 3].abs().sum() == 0
    assert got[2].abs().sum() > 0  # expert 0's w1 gradient carries signal

    # the backward operator alone returns the same, and its fake kernel the shapes
    dz, dweights, dw1, dw3, dw2 = moe_experts_backward(du, z.detach(), experts, weights.detach(), w1, w3, w2, *act)
    torch.testing.assert_close(dz, got[0], rtol=0, atol=0)
    torch.testing.assert_close(dweights, got[1], rtol=0, atol=0)
    assert [t.shape for t in (*dw1, *dw3, *dw2)] == [w.shape for w in (*w1, *w3, *w2)]


@pytest.mark.parametrize("act", ACTS, ids=[a[0] for a in ACTS])
def test_glu_backward_equals_autograd_of_the_formula(act):
    gen = torch.Generator().manual_seed(3)
    g, u, dy = (torch.randn(5, 13, generator=gen, dtype=torch.float64) * 6 for _ in range(3))
    g.requires_grad_(), u.requires_grad_()
    name, b1, b2 = act
    y = situ_reference(g, u, b1, b2) if name == "situ" else torch.nn.functional.silu(g) * u
    want = torch.autograd.grad(y, (g, u), dy)
    h, parts = glu_parts(g.detach(), u.detach(), *act)
    torch.testing.assert_close(h, glu(g.detach(), u.detach(), *act), rtol=0, atol=0)
    got = glu_backward(parts, dy, *act)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_compiled_training_step_equals_eager_in_float64():
    """One graph (fullgraph: a graph break fails the test) and its AOTAutograd backward: the loss and every
    parameter's gradient equal to the eager model's to fp64 rounding, over routing with random router biases."""
    # four layers (KDA, KDA, KDA, MLA) with a dense first FFN and three MoE ones: every kind of sublayer, traced
    # and compiled in less time than the preset's five
    small = dict(router_bias_std=0.3, num_hidden_layers=4, full_attn_layers=(4,))
    eager, compiled = tiny_model(**small), tiny_model(**small)
    loss, grads = loss_and_grads(eager, seed=5)
    compiled.train()
    # aot_eager: Dynamo's trace and AOTAutograd's joint graph as `k3 train --compile` builds them, run by ATen
    # (Inductor's code generation costs ~90 s of a cold cache here; the slow test below runs it end to end)
    function = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, compiled.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(5))
    out = function(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), loss, rtol=1e-12, atol=0)
    # the experts operator gives idle experts zero gradients; IdleExperts puts them back to None, as eagerly
    idle = IdleExperts(compiled)
    idle.observe(out.routing)
    assert any(not u.all() for u in idle.used), "the test wants an expert that no token chose"
    idle.release()
    names = [n for n, p in compiled.named_parameters() if p.grad is not None]
    assert names == list(grads)
    for name, p in compiled.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-9, atol=1e-12, msg=name)


def test_compile_blockers_name_the_reason():
    model = tiny_model()
    assert compile_blocker(model) is None
    assert "one process" in compile_blocker(model, world_size=2)
    from k3.model.quantization import set_expert_quantization

    set_expert_quantization(model, "mxfp4")
    assert "--qat" in compile_blocker(model)
    with pytest.raises(ValueError, match="--compile: routed experts under quantisation-aware training"):
        compile_training(model)


def test_train_refuses_compile_with_qat_and_a_bad_dtype_before_writing(tmp_path, capsys):
    from k3.cli import main

    assert main(["train", "--out", str(tmp_path / "a"), "--preset", "tiny", "--dtype", "fp8"]) == 2
    assert "--dtype must be one of auto, float32, bfloat16, got 'fp8'" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    args = ["train", "--out", str(tmp_path / "b"), "--preset", "tiny", "--qat", "mxfp4", "--compile", "--steps", "1"]
    assert main(args) == 2
    assert "--compile: routed experts under quantisation-aware training" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_compiled_trainer_follows_eager_over_fifty_steps_and_resumes_bitwise(tmp_path):
    """k3 train --compile: 50 steps within fp32 noise of the eager run's losses, and a compiled run killed after
    step 26 (SIGKILL, its last checkpoint at 25) then resumed under --compile equals the unbroken compiled run
    bitwise."""
    from k3.cli import main

    data = tmp_path / "data.txt"
    data.write_text("".join(f"def f_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    common = ["--preset", "tiny", "--steps", "50", "--batch-size", "2", "--seq-len", "32", "--vocab-size", "300"]
    common += ["--eval-every", "50", "--ckpt-every", "5", "--data", str(data), "--no-progress"]
    assert main(["train", *common, "--out", str(tmp_path / "eager")]) == 0
    assert main(["train", *common, "--compile", "--out", str(tmp_path / "whole")]) == 0
    broken = ["train", *common, "--compile", "--out", str(tmp_path / "broken")]
    killed = subprocess.run(
        [sys.executable, "-m", "k3.cli", *broken], env={**os.environ, KILL_ENV: "0:step:26"}, capture_output=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert len(losses(tmp_path / "broken")) == 25
    assert main([*broken, "--resume"]) == 0

    eager, whole = losses(tmp_path / "eager"), losses(tmp_path / "whole")
    torch.testing.assert_close(torch.tensor(whole), torch.tensor(eager), rtol=2e-4, atol=0)
    assert losses(tmp_path / "broken") == whole  # every step, bitwise (JSON keeps every float digit)


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_forward_that_fails_to_compile_runs_eagerly_from_then_on():
    model = tiny_model().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    said = []
    try:
        step = compile_training(model, log=said.append)
        assert torch.are_deterministic_algorithms_enabled()
    finally:  # the mode is the training process's; the tests after this one run without it
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = True
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("backend failed\nlong trace")

    step.compiled = broken
    first, second = step(ids, labels=ids), step(ids, labels=ids)
    assert calls == [1]  # tried once, then eager
    assert said == ["--compile: the step did not compile, it runs eagerly from here: RuntimeError: backend failed"]
    want = model(ids, labels=ids).loss
    assert first.loss.item() == second.loss.item() == want.item()
