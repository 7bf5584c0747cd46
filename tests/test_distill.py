"""k3.distill: the reverse-KL loss, on-policy sampling from the current weights, teacher routing by domain,
exact resume, the errors, and `k3 distill`."""

import json
import math
import shutil

import pytest
import torch

from k3.cli import main
from k3.distill.distiller import DistillArgs, Distiller
from k3.distill.loss import reverse_kl
from k3.distill.sampler import OnPolicySampler
from k3.distill.teachers import TeacherError, TeacherSpec, route
from k3.formats.checkpoint import load_checkpoint, save_checkpoint
from k3.formats.tokenizer import K3Tokenizer
from k3.hub import load_pretrained


def test_reverse_kl_two_tokens_by_hand():
    # p_s = (0.8, 0.2), p_t = (0.5, 0.5): KL = 0.8 ln 1.6 + 0.2 ln 0.4 = 0.19274476
    student = torch.tensor([[math.log(0.8), math.log(0.2)]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    kl = reverse_kl(student, teacher)
    assert kl.item() == pytest.approx(0.8 * math.log(1.6) + 0.2 * math.log(0.4), abs=1e-15)
    assert kl.item() == pytest.approx(0.19274476, abs=1e-8)
    kl.sum().backward()
    # dKL/dz_j = p_s(j) (log p_s(j) - log p_t(j) - KL): (0.8 (ln 1.6 - KL), 0.2 (ln 0.4 - KL)) = (0.2218071, -0.2218071)
    k = kl.item()
    expected = [0.8 * (math.log(1.6) - k), 0.2 * (math.log(0.4) - k)]
    assert student.grad[0].tolist() == pytest.approx(expected, abs=1e-15)
    assert expected[0] == pytest.approx(0.2218071, abs=1e-7)
    # reverse, not forward: KL(p_t || p_s) = 0.5 ln 0.625 + 0.5 ln 2.5 = 0.2231436 differs
    assert 0.5 * math.log(0.625) + 0.5 * math.log(2.5) - k > 0.03


def test_reverse_kl_full_vocabulary_and_gradient():
    # p_s = (1/4, 1/2, 1/4), p_t = (1/8, 1/8, 3/4): every vocabulary entry counts
    ps, pt = [0.25, 0.5, 0.25], [0.125, 0.125, 0.75]
    student = torch.tensor([[math.log(p) for p in ps]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[math.log(p) + 3.0 for p in pt]], dtype=torch.float64)  # a shift changes nothing
    kl = reverse_kl(student, teacher)
    by_hand = 0.25 * math.log(2) + 0.5 * math.log(4) + 0.25 * math.log(1 / 3)
    assert kl.item() == pytest.approx(by_hand, abs=1e-14)
    kl.backward()
    grad = [p * (math.log(p / q) - by_hand) for p, q in zip(ps, pt, strict=True)]
    assert student.grad[0].tolist() == pytest.approx(grad, abs=1e-14)
    assert sum(grad) == pytest.approx(0, abs=1e-15)  # softmax: logits move, not mass
    same = torch.randn(5, 7, dtype=torch.float64)
    assert reverse_kl(same, same + 1).abs().max().item() < 1e-15
    with pytest.raises(ValueError, match="differ in shape"):
        reverse_kl(torch.zeros(2, 3), torch.zeros(2, 4))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints with the byte-level tokenizer: a student, a copy (a teacher equal to the student) and
    another initialisation."""
    root = tmp_path_factory.mktemp("distill")
    for name, seed in (("student", "0"), ("other", "1")):
        assert main(["init", "--preset", "tiny", "--seed", seed, "--out", str(root / name)]) == 0
    shutil.copytree(root / "student", root / "same")
    return root


def _args(ckpts, out, **kw) -> DistillArgs:
    teacher = [f"reasoning-low={ckpts / 'same'}", f"reasoning-high={ckpts / 'other'}"]
    values = dict(
        student=str(ckpts / "student"),
        out=str(out),
        steps=3,
        batch_size=4,
        max_new_tokens=8,
        teacher=teacher,
        progress=False,
    )
    return DistillArgs(**{**values, **kw})


def test_sampler_follows_the_current_weights(ckpts):
    model = load_pretrained(ckpts / "student").model
    tokenizer = K3Tokenizer.load(ckpts / "student" / "tokenizer.json")
    prompts, seeds = [tokenizer.encode("Task (low effort): 1 + 2\n"), tokenizer.encode("x = ")], [3, 4]
    sampler = OnPolicySampler(model, tokenizer, max_new_tokens=12)
    sampler.refresh(model, 0)
    before = sampler.sample(prompts, seeds)
    assert sampler.sample(prompts, seeds) == before  # seeded: the same weights give the same samples
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    assert sampler.sample(prompts, seeds) == before  # not refreshed: still the old weights
    sampler.refresh(model, 1)
    after = sampler.sample(prompts, seeds)
    assert after != before and sampler.weights_step == 1
    fresh = OnPolicySampler(model, tokenizer, max_new_tokens=12)
    assert fresh.sample(prompts, seeds) == after  # the refresh is complete: nothing of the old weights is kept


def test_each_domain_is_scored_by_its_teacher(ckpts, tmp_path):
    # the teacher equal to the student gives KL 0 on its domain (up to fp32 rounding), the other does not
    first = Distiller(_args(ckpts, tmp_path / "a", steps=1))._step()
    assert first["loss/reasoning-low"] < 1e-6 < 1e-3 < first["loss/reasoning-high"]
    swapped = [f"reasoning-high={ckpts / 'same'}", f"reasoning-low={ckpts / 'other'}"]
    second = Distiller(_args(ckpts, tmp_path / "b", steps=1, teacher=swapped))._step()
    assert second["loss/reasoning-high"] < 1e-6 < 1e-3 < second["loss/reasoning-low"]
    assert route([TeacherSpec.parse("code+tests=a"), TeacherSpec.parse("docs=b")]) == {"code": 0, "tests": 0, "docs": 1}


def test_kill_mid_run_resumes_to_the_same_losses(ckpts, tmp_path, monkeypatch):
    # refresh every 3 steps: the checkpoint at step 2 holds a sampler still at step 0's weights
    args = dict(steps=5, ckpt_every=2, refresh_every=3)
    whole = Distiller(_args(ckpts, tmp_path / "whole", **args))
    whole.train()
    expected = [(r["step"], r["loss"], r.get("loss/reasoning-low")) for r in whole.metrics()]
    broken = Distiller(_args(ckpts, tmp_path / "broken", **args))
    step = Distiller._step

    def killed_at_4(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Distiller, "_step", killed_at_4)
    with pytest.raises(KeyboardInterrupt):
        broken.train()
    monkeypatch.setattr(Distiller, "_step", step)
    assert load_checkpoint(tmp_path / "broken").state["sampler_step"] == 0
    resumed = Distiller(_args(ckpts, tmp_path / "broken", resume=True, **args))
    assert resumed.step == 2 and resumed.sampler.weights_step == 0
    resumed.train()
    got = [(r["step"], r["loss"], r.get("loss/reasoning-low")) for r in resumed.metrics()]
    assert got == expected and len(got) == 5
    with pytest.raises(ValueError, match=r"--lr: the run recorded 0\.001, now 0\.002"):
        Distiller(_args(ckpts, tmp_path / "broken", resume=True, lr=2e-3, **args))


def test_sft_baseline_trains_on_the_documents_continuations(ckpts, tmp_path):
    d = Distiller(_args(ckpts, tmp_path / "sft", objective="sft", teacher=[], mix="reasoning-low=1", steps=1))
    prompts = d.draw(0)
    model = load_pretrained(ckpts / "student").model
    nll, count = 0.0, 0
    for p in prompts:  # the same prompts, the document's own worked answer, cross-entropy by hand
        row = torch.tensor([p.ids + p.reference])
        logp = torch.log_softmax(model(row).logits[0].double(), -1)
        for j, token in enumerate(p.reference):
            nll -= logp[len(p.ids) - 1 + j, token].item()
        count += len(p.reference)
    record = d._step()
    assert record["tokens"] == count and record["loss"] == pytest.approx(nll / count, rel=1e-5)


@pytest.mark.parametrize(
    ("teacher", "message"),
    [
        (["reasoning-low"], "write NAME=CKPT"),
        (["maths={same}"], "'maths' is not a domain"),
        (["reasoning-low={same}", "all={other}"], "the reasoning-low domain has two teachers"),
        (["reasoning-low={same}/nope"], "nope: no such checkpoint, run or model folder"),
    ],
)
def test_readable_teacher_errors(ckpts, tmp_path, teacher, message):
    with pytest.raises((TeacherError, FileNotFoundError), match=message):
        Distiller(
            _args(
                ckpts, tmp_path / "x", teacher=[t.format(same=ckpts / "same", other=ckpts / "other") for t in teacher]
            )
        )
    assert not (tmp_path / "x").exists()  # a mistake leaves no files


def test_vocabulary_mismatch_and_mixture_errors(ckpts, tmp_path):
    wider = tmp_path / "wider"  # the student's tokenizer, a model with a larger vocabulary
    pretrained = load_pretrained(ckpts / "student")
    config = pretrained.config.__class__.from_preset("tiny", vocab_size=pretrained.config.vocab_size + 64)
    from k3.model import K3Model
    from k3.train.optim import build_optimizer

    model = K3Model(config)
    wider.mkdir()
    shutil.copy(ckpts / "student" / "tokenizer.json", wider)
    save_checkpoint(
        wider,
        0,
        model,
        build_optimizer(model, lr=1e-3, weight_decay=0.0),
        config,
        {"position": 0, "tokenizer": "tokenizer.json"},
    )
    with pytest.raises(TeacherError, match="vocabulary mismatch: the teacher's model has"):
        Distiller(_args(ckpts, tmp_path / "x", teacher=[f"all={wider}"]))
    retokenized = tmp_path / "retok"
    shutil.copytree(ckpts / "other", retokenized)
    tok = json.loads((retokenized / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] += "x"
    (retokenized / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TeacherError, match=r"its tokenizer\.json differs from the student's"):
        Distiller(_args(ckpts, tmp_path / "x", teacher=[f"all={retokenized}"]))
    with pytest.raises(TeacherError, match="--mix draws from code, which no --teacher owns"):
        _args(ckpts, tmp_path / "x", mix="reasoning-low=1,code=2")
    with pytest.raises(ValueError, match="'code=-1': each domain once, with a positive weight"):
        _args(ckpts, tmp_path / "x", teacher=[f"all={ckpts / 'same'}"], mix="code=-1")


def test_k3_distill_command(ckpts, tmp_path, capsys):
    out = tmp_path / "merged"
    argv = [
        "distill",
        "--student",
        str(ckpts / "student"),
        "--teacher",
        f"reasoning-low={ckpts / 'same'}",
        "--teacher",
        f"reasoning-high={ckpts / 'other'}",
        "--mix",
        "reasoning-low=1,reasoning-high=3",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "4",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 2 and "loss" in summary
    assert load_pretrained(out).config.vocab_size == load_pretrained(ckpts / "student").config.vocab_size
    assert main(argv) == 2  # checkpoints there and no --resume
    assert "already holds checkpoints: pass --resume" in capsys.readouterr().err
    assert main([*argv[:-2], "--teacher", "code", "--out", str(tmp_path / "y")]) == 2
    assert "write NAME=CKPT" in capsys.readouterr().err


def test_domain_evaluation(ckpts):
    from k3.distill.evaluate import evaluate_domains, held_out_tokens
    from k3.eval import score_tokens

    (score,) = evaluate_domains(ckpts / "student", ["reasoning-low"], max_tokens=200, tasks=3)
    tokenizer = K3Tokenizer.load(ckpts / "student" / "tokenizer.json")
    ids = held_out_tokens("reasoning-low", tokenizer, 200)
    assert len(ids) == 200 and ids.count(tokenizer.eos_id) >= 3  # several held-out tasks, not one
    nll, count = score_tokens(load_pretrained(ckpts / "student").model, ids, 256, 4)
    assert score.tokens == count == 199 and score.val_loss == pytest.approx(nll / count, rel=1e-6)
    assert score.tasks == 3 and score.accuracy == 0.0  # a random model does not answer sums


def test_sigkill_mid_run_resumes_to_the_same_losses(ckpts, tmp_path):
    """A real kill (SIGKILL, whatever step or write it lands in), then `k3 distill --resume`."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def command(out):
        return [
            sys.executable,
            "-m",
            "k3.cli",
            "distill",
            "--student",
            str(ckpts / "student"),
            "--teacher",
            f"all={ckpts / 'other'}",
            "--mix",
            "reasoning-low=1,reasoning-high=1",
            "--steps",
            "30",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "4",
            "--ckpt-every",
            "4",
            "--refresh-every",
            "3",
            "--no-progress",
            "--out",
            str(out),
        ]

    def losses(out):
        from k3.formats.files import latest_timeline, read_jsonl

        return [(r["step"], r["loss"]) for r in latest_timeline(read_jsonl(out / "metrics.jsonl"))]

    subprocess.run(command(tmp_path / "whole"), env=env, check=True, capture_output=True)
    proc = subprocess.Popen(command(tmp_path / "killed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 10):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
    subprocess.run([*command(tmp_path / "killed"), "--resume"], env=env, check=True, capture_output=True)
    assert losses(tmp_path / "killed") == losses(tmp_path / "whole") and len(losses(tmp_path / "whole")) == 30
