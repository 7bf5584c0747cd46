"""The draft model, its features, its training and its folder (issue 15)."""

import json

import numpy as np
import pytest
import torch

from k3.cli import main
from k3.config import K3Config
from k3.model.attn_res import attn_res
from k3.serve.llm import LLM
from k3.serve.sampling import SamplingParams
from k3.spec.draft import DraftModel
from k3.spec.features import block_summaries, feature_blocks
from k3.spec.folder import DraftFolderError, load_draft, save_draft
from k3.spec.train_draft import DraftTrainConfig, evaluate, train_draft
from tiny_models import tiny_model


def test_feature_blocks_are_1_4_final_or_first_middle_last():
    assert feature_blocks(K3Config.from_preset("k3")) == (1, 4, len(K3Config.from_preset("k3").attn_res_blocks))
    assert feature_blocks(K3Config.from_preset("small")) == (1, 2, 3)
    assert feature_blocks(K3Config.from_preset("tiny")) == (1, 2, 3)
    with pytest.raises(ValueError, match="standard residuals"):
        feature_blocks(K3Config.from_preset("tiny", residual="standard"))


def test_block_summaries_are_the_blocks_the_final_readout_mixes():
    model = tiny_model(seed=1)
    ids = torch.randint(0, 500, (2, 9))
    with block_summaries(model) as capture:
        out = model(ids)
        blocks = capture.summaries((1, 2, 3))
    text = model.model
    hidden = text.norm(
        attn_res([text.embed_tokens(ids), *blocks], text.output_attn_res_proj, text.output_attn_res_norm)
    )
    torch.testing.assert_close(model.lm_head(hidden), out.logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["chain", "block"])
def test_proposing_equals_the_training_unroll(mode):
    """propose (inference, cached chain) and unroll (training, the proposals as teacher tokens) compute the
    same logits: the draft is trained exactly as it runs."""
    model = tiny_model(seed=2)
    draft = DraftModel(model.config, mode=mode, num_speculative_tokens=5).double().attach(model)
    tokens, g0 = torch.randint(0, 500, (3,)), torch.randn(3, model.config.hidden_size, dtype=torch.float64)
    seen = []  # the logits each proposal was chosen from, caught by choose as the proposer's choose does

    def choose(lg, j):
        seen.append(lg)
        return lg.argmax(-1)

    proposals = draft.propose(tokens, g0, 5, choose)
    logits = torch.stack(seen, dim=1)
    assert proposals.shape == (3, 5)
    unrolled = draft.unroll(torch.cat([tokens[:, None], proposals[:, :-1]], 1), g0)
    torch.testing.assert_close(unrolled, logits, rtol=0, atol=1e-12)
    assert not any(n.startswith(("embed", "lm_head")) for n in draft.state_dict())  # shared, never saved


def _draft_config(out, **changes) -> DraftTrainConfig:
    values = dict(objective="alpha", steps=30, lr=3e-3, num_speculative_tokens=3, prompt_tokens=8, new_tokens=22)
    values |= dict(batch_sequences=4, starts_per_sequence=8, ckpt="unused", progress=False)
    return DraftTrainConfig(out=str(out), **{**values, **changes})


def test_training_for_acceptance_raises_the_acceptance(tmp_path):
    model = tiny_model(seed=4).float()
    data = torch.randint(0, 500, (12, 30))
    cfg = _draft_config(tmp_path / "draft")
    before = evaluate(model, DraftModel(model.config, num_speculative_tokens=3).attach(model), data[8:], 8)
    _, report = train_draft(model, data[:8], data[8:], cfg, log=lambda s: None)
    assert report["steps"] == 30 and len(report["alpha_at"]) == 3
    assert report["tokens_per_step_sampled"] > before["tokens_per_step_sampled"]


def test_an_interrupted_draft_training_resumes_to_the_unbroken_one(tmp_path, monkeypatch):
    """As every training loop: checkpoints every --ckpt-every steps, and --resume continues from the newest
    to the same losses and the same draft, bitwise (no time limit in reach)."""
    import k3.spec.train_draft as train_draft_module

    model = tiny_model(seed=4).float()
    data = torch.randint(0, 500, (12, 30))
    config = dict(steps=5, ckpt_every=2, time_limit_s=1e9)

    def quiet(message: str) -> None:
        pass

    whole, _ = train_draft(model, data[:8], data[8:], _draft_config(tmp_path / "whole", **config), log=quiet)
    losses = train_draft_module.step_losses
    calls = []

    def interrupted_at_step_4(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return losses(*args)

    monkeypatch.setattr(train_draft_module, "step_losses", interrupted_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train_draft(model, data[:8], data[8:], _draft_config(tmp_path / "broken", **config), log=quiet)
    monkeypatch.setattr(train_draft_module, "step_losses", losses)
    resumed, _ = train_draft(
        model, data[:8], data[8:], _draft_config(tmp_path / "broken", resume=True, **config), quiet
    )

    def logged(run):  # step -> loss as the run finally went (a resumed step's line replaces the first)
        return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}

    assert logged(tmp_path / "broken") == logged(tmp_path / "whole") and len(logged(tmp_path / "whole")) == 5
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"--lr: the run recorded 0\.003, now 0\.002"):
        train_draft(model, data[:8], data[8:], _draft_config(tmp_path / "broken", resume=True, lr=2e-3, **config))


def test_draft_folder_round_trip_and_errors(tmp_path):
    model = tiny_model(seed=6)
    draft = DraftModel(model.config, mode="block", num_speculative_tokens=4).double()
    folder = save_draft(draft, model, tmp_path / "d")
    loaded = load_draft(folder, model)
    assert loaded.mode == "block" and loaded.num_speculative_tokens == 4
    for a, b in zip(draft.state_dict().values(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(DraftFolderError, match="not a folder"):
        load_draft(tmp_path / "missing", model)
    with pytest.raises(DraftFolderError, match="other weights"):
        load_draft(folder, tiny_model(seed=7))
    with pytest.raises(DraftFolderError, match="hidden_size"):
        load_draft(folder, K3ModelOf(hidden_size=32))
    meta = json.loads((folder / "draft.json").read_text())
    (folder / "draft.json").write_text(json.dumps({**meta, "format": "something-else"}))
    with pytest.raises(DraftFolderError, match="format"):
        load_draft(folder, model)
    (folder / "draft.json").write_text("{not json")
    with pytest.raises(DraftFolderError, match="not valid JSON"):
        load_draft(folder, model)
    (folder / "draft.json").write_text(json.dumps(meta))
    (folder / "draft.safetensors").write_bytes(b"garbage")
    with pytest.raises(DraftFolderError, match="corrupt"):
        load_draft(folder, model)


def K3ModelOf(**overrides):
    from k3 import K3Model

    return K3Model(K3Config.from_preset("tiny", **overrides))


def test_train_draft_cli_and_llm_speculative_model(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "draft"
    assert main(["init", "--preset", "tiny", "--out", str(ckpt)]) == 0
    corpus = tmp_path / "tokens.npy"
    np.save(corpus, np.random.default_rng(0).integers(0, 256, 4000).astype(np.int32))
    assert (
        main(
            [
                "train-draft",
                "--ckpt",
                str(ckpt),
                "--out",
                str(out),
                "--data",
                str(corpus),
                "--val-data",
                str(corpus),
                "--steps",
                "2",
                "--train-sequences",
                "4",
            ]
        )
        == 0
    )
    assert (out / "draft.safetensors").is_file() and "greedy_acceptance_at" in json.loads(
        (out / "draft.json").read_text()
    )["training"]
    params = SamplingParams(temperature=0, max_tokens=12)
    with LLM(str(ckpt), memory_budget=8 << 20) as plain:
        ref = plain.generate(["import os", "def f(x):"], params)
    with LLM(str(ckpt), memory_budget=8 << 20, speculative_model=str(out)) as spec:
        got = spec.generate(["import os", "def f(x):"], params)
        assert spec.engine.spec_stats.verify_steps > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    with pytest.raises(DraftFolderError, match=r"no draft\.json"):
        LLM(str(ckpt), speculative_model=str(tmp_path))
    assert main(["serve", "--model", str(ckpt), "--speculative-model", str(tmp_path / "none")]) == 2
