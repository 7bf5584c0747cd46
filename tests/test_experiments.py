"""experiments/*.py --quick end to end (slow): each writes its table and PNG, its numbers say what the claim
says where the quick scale can show it, and a rerun reuses the stored results instead of recomputing."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3.cli import main

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A run folder with a small tokenizer and packed tokens for the experiments' training runs."""
    root = tmp_path_factory.mktemp("evidence")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(150):
        body = "".join(f"    total_{j} = compute(values[{j}], {i}) + offset_{i % 7}\n" for j in range(12))
        (corpus / f"module_{i:03d}.py").write_text(f"def function_{i}(values):\n{body}    return total_0\n")
    run = root / "base"
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny",
                "--steps",
                "1",
                "--vocab-size",
                "400",
                "--val-fraction",
                "0.1",
                "--seq-len",
                "64",
                "--batch-size",
                "2",
                "--data",
                str(corpus),
                "--out",
                str(run),
                "--no-progress",
            ]
        )
        == 0
    )
    return run


def run_quick(name: str, out: Path, base: Path) -> dict:
    env = {**os.environ, "K3_EVIDENCE_BASE": str(base), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / f"{name}.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / f"{name}.png").stat().st_size > 10_000
    assert (out / "table.md").read_text().count("|") > 20
    return json.loads((out / "results.json").read_text())


def test_quantile_balancing_quick(tmp_path, base):
    r = run_quick("quantile_balancing", tmp_path, base)
    step2 = {rule: r[f"synthetic/{rule}/0"]["maxvio"][1] for rule in ("qb", "qb-exact", "fixed", "none", "floor")}
    assert step2["qb"] < step2["fixed"] / 5 and step2["qb-exact"] < step2["fixed"] / 5  # one update balances
    assert step2["floor"] < step2["qb"] < step2["none"]
    runs = {rule: r[f"train/{rule}/s0"] for rule in ("qb", "fixed", "none")}  # --balancer none logs MaxVio too
    assert all(len(run["maxvio"]) == len(run["loss"]) == 6 and run["val_loss"] for run in runs.values())
    assert "train/qb-exact/s0" not in r  # the exact cutoff is compared on synthetic scores only

    evidence = json.loads((tmp_path / "evidence.json").read_text())
    assert evidence["seeds"] == [0] and evidence["steps"] == 6 and len(evidence["rows"]) == 3
    last_half = {rule: sum(run["maxvio"][3:]) / 3 for rule, run in runs.items()}
    assert {row["rule"]: row["maxvio_first_10"] for row in evidence["rows"]} == pytest.approx(
        {rule: sum(run["maxvio"]) / 6 for rule, run in runs.items()}
    )
    assert {row["rule"]: row["maxvio_last_half"] for row in evidence["rows"]} == pytest.approx(last_half)
    val = {rule: run["val_loss"][-1] for rule, run in runs.items()}
    below = last_half["qb"] < min(last_half["fixed"], last_half["none"])
    no_cost = val["qb"] <= min(val["fixed"], val["none"]) + 0.02
    not_below_fixed = last_half["qb"] >= last_half["fixed"]
    expected = "reproduced" if below and no_cost else "not reproduced" if not_below_fixed else "mixed"
    assert evidence["verdict"] == expected  # one seed: the rule's "for every seed" is this seed


def test_bounded_numerics_quick_and_rerun_reuses_results(tmp_path, base):
    r = run_quick("bounded_numerics", tmp_path, base)
    at_bound = r["kda/8192/const-5.0"]
    assert at_bound["finite"] and at_bound["rel_rms"] < 1e-5 and at_bound["pivoted"] == 0.0
    assert at_bound["textbook"] > 0.3  # the unpivoted split overflows at the bound already
    assert r["kda/8192/const-20.0"]["pivoted"] > 0  # past the bound the fast split overflows too
    assert max(r["situ"]["situ_max"]) <= 100.0 and max(r["situ"]["swiglu_max"]) > 1e6
    again = run_quick("bounded_numerics", tmp_path, base)
    assert again == r  # stored results (their timings included) were reused, not recomputed


def test_attn_res_quick(tmp_path, base):
    r = run_quick("attn_res", tmp_path, base)
    for when in ("init", "trained"):
        attn, std = r[f"rms/attnres/{when}/s0"]["rms"], r[f"rms/standard/{when}/s0"]["rms"]
        assert std[-1] / std[0] > 2 * attn[-1] / attn[0]  # the running sum grows with depth; the mixture less
    assert r["train/standard x1.25/s0"]["val"][-1][0] == 8  # round(1.25 * 6) steps, evaluated at the end
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    assert evidence["verdict"] in ("reproduced", "not reproduced", "mixed")
    assert evidence["seeds"] == [0] and evidence["steps"] == {"attnres": 6, "standard": 6, "standard x1.25": 8}
    # the evidence's rows are the stored results, not numbers computed apart from them
    stored = {(name, 0): r[f"train/{name}/s0"]["val"][-1][1] for name in ("attnres", "standard", "standard x1.25")}
    assert {(row["name"], row["seed"]): row["val_loss"] for row in evidence["rows"]} == stored


def test_hybrid_quick(tmp_path, base):
    r = run_quick("hybrid", tmp_path, base)
    kda = [r[f"decode/all KDA/{n}"]["kda_bytes"] + r[f"decode/all KDA/{n}"]["mla_bytes"] for n in (256, 1024, 2048)]
    mla = [r[f"decode/all MLA/{n}"]["mla_bytes"] for n in (256, 1024, 2048)]
    assert kda[0] == kda[1] == kda[2]  # a fixed-size state
    assert mla[1] == 4 * mla[0] and mla[2] == 8 * mla[0]  # one latent per token per layer
    assert all(0 <= r[f"eval/{v}/retrieval/128"]["accuracy"] <= 1 for v in ("hybrid 3:1", "all KDA", "all MLA"))


def test_nope_extension_quick(tmp_path, base):
    r = run_quick("nope_extension", tmp_path, base)
    for name in ("64 only", "64 then 256"):
        assert [r[f"eval/{name}/s0/{n}"]["windows"] >= 1 for n in (64, 256, 1024)] == [True] * 3
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    assert evidence["seeds"] == [0] and evidence["quick"]
    gain = r["eval/64 only/s0/1024"]["late"] - r["eval/64 then 256/s0/1024"]["late"]
    assert evidence["gain_at_16L"] == [{"seed": 0, "nats": pytest.approx(gain, abs=1e-12)}]
    assert evidence["verdict"] == ("reproduced" if gain > 0.01 else "not reproduced")
    assert evidence["no_breakdown"] == [
        {"training": name, "seed": 0, "holds": r[f"eval/{name}/s0/1024"]["late"] <= r[f"eval/{name}/s0/64"]["late"]}
        for name in ("64 only", "64 then 256")
    ]


def test_latent_moe_quick(tmp_path, base):
    r = run_quick("latent_moe", tmp_path, base)
    latent, full = r["train/LatentMoE/s0"], r["train/full-width MoE/s0"]
    assert len(latent["val"]) == len(full["val"]) == 4
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    (row,) = evidence["rows"]
    assert row["latent_minus_full"] == pytest.approx(latent["val"][-1][1] - full["val"][-1][1], abs=1e-12)
    assert evidence["verdict"] == ("reproduced" if row["latent_minus_full"] <= 0.02 else "not reproduced")
    table = (tmp_path / "table.md").read_text()
    assert "| k3 | LatentMoE | 3584 | 3072 | 33,030,144 |" in table
    assert "| 229,376 |" in table and "| 458,752 |" in table  # full width: twice the all-to-all bytes


def test_k3_vs_llama_quick(tmp_path, base):
    pytest.importorskip("transformers")
    r = run_quick("k3_vs_llama", tmp_path, base)
    models = r["race/10/on/s0"]["models"]
    for name in ("K3 small", "Llama"):
        (steps_1, seconds_1, _), (steps_4, seconds_4, _) = models[name]["val"]
        assert seconds_1 >= 10 and seconds_4 >= 40 and steps_4 > steps_1  # each measured at its own B and 4B
        assert models[name]["first_step_s"] > 0  # the compiling step, off the clock
        assert models[name]["sample"].startswith("def fibonacci(n):\n")
    assert abs(models["Llama"]["active"] / models["K3 small"]["active"] - 1) < 0.1  # equal active parameters
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    (row,) = evidence["rows"]
    gap = models["K3 small"]["val"][-1][2] - models["Llama"]["val"][-1][2]
    assert row["seed"] == 0 and row["k3_minus_llama"][-1] == pytest.approx(gap, abs=1e-12)
    assert evidence["verdict"] == ("reproduced" if gap <= 0 else "not reproduced")


def test_qat_quick_and_rerun_reuses_results(tmp_path, base):
    r = run_quick("qat", tmp_path, base)
    assert r["warm"]["steps"] == 4 and r["train/fp/s1"]["steps"] == r["train/qat/s1"]["steps"] == 4
    models = ("fp", "qat", "qat-master", "ptq", "ptq-weights")
    loss = {m: r[f"eval/{m}/s1"]["val_loss"] for m in models}
    assert all(math.isfinite(v) for v in loss.values())
    assert loss["qat"] != loss["qat-master"] and loss["ptq"] != loss["fp"]  # the served models are rounded
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    assert evidence["verdict"] in ("reproduced", "not reproduced", "mixed")
    assert evidence["seeds"] == [1] and evidence["steps"] == {"warm": 4, "fp": 4, "qat": 4}
    # the evidence's rows are the stored results, not numbers computed apart from them
    (row,) = evidence["rows"]
    assert row["seed"] == 1 and row["val_loss"] == loss
    assert row["qat_vs_ptq"] == pytest.approx(loss["qat"] - loss["ptq"], abs=1e-12)
    assert row["ptq_cost"] == pytest.approx(loss["ptq"] - loss["fp"], abs=1e-12)
    assert evidence["ptq_cost"] == [{"seed": 1, "nats": row["ptq_cost"], "costs": row["ptq_cost"] > 0.001}]
    again = run_quick("qat", tmp_path, base)
    assert again == r  # stored results (their timings included) were reused, not retrained or rescored


def test_mqar_quick_and_rerun_reuses_results(tmp_path, base):

    r = run_quick("mqar", tmp_path, base)
    runs = {variant: r[f"{variant}/s0"] for variant in ("hybrid 3:1", "all KDA", "all MLA")}
    for run in runs.values():
        assert len(run["loss"]) == 20 and set(run["accuracy"]) == {"2", "8"}
        assert all(0.0 <= a <= 1.0 for a in run["accuracy"].values())
    # the variants differ in their MLA layers only, so their sizes are close but not equal
    assert len({run["params"] for run in runs.values()}) == 3
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    assert evidence["seeds"] == [0] and evidence["pairs"] == [2, 8] and evidence["quick"]
    assert {row["variant"]: row["accuracy"]["8"] for row in evidence["rows"]} == {
        variant: run["accuracy"]["8"] for variant, run in runs.items()
    }
    acc = {variant: run["accuracy"]["8"] for variant, run in runs.items()}
    gap = 0.10
    shown = acc["hybrid 3:1"] >= acc["all MLA"] - gap and acc["all KDA"] <= acc["hybrid 3:1"] - gap
    assert evidence["verdict"] == ("reproduced" if shown else "not reproduced")
    again = run_quick("mqar", tmp_path, base)
    assert again == r


def test_distillation_quick(tmp_path, base):
    r = run_quick("distillation", tmp_path, base)
    domains = ("reasoning-low", "reasoning-high")
    assert set(r) >= {"base", "teacher/reasoning-low", "teacher/reasoning-high", "student/s0"}
    assert len(r["student/s0"]["loss"]) == 3  # S = 3 distillation steps, each with a finite reverse KL
    assert all(math.isfinite(x) and x >= 0 for x in r["student/s0"]["loss"])
    for step in (1, 2, 3):  # the student at S/3, 2S/3 and S
        assert set(r[f"eval/student-s0@{step}"]["loss"]) == set(domains)
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    (row,) = evidence["rows"]
    for d in domains:  # the evidence's shares are the stored losses', not numbers computed apart from them
        base_loss, teacher, student = (r[f"eval/{m}"]["loss"][d] for m in ("base", f"teacher-{d}", "student-s0@3"))
        assert teacher != base_loss  # the specialist was trained
        assert row["gap_closed"][d] == pytest.approx((base_loss - student) / (base_loss - teacher), abs=1e-12)
    assert evidence["verdict"] == ("reproduced" if min(row["gap_closed"].values()) >= 0.5 else "not reproduced")
