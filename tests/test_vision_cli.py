"""`k3 train --preset small-vl` and `k3 generate --image`, end to end on a two-step run."""

import json

import pytest
import torch
from PIL import Image

from k3.cli import main
from k3.data.images import example


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl") / "run"
    argv = [
        "train",
        "--preset",
        "small-vl",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--eval-batches",
        "1",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    return out


def test_train_writes_a_loadable_vision_run(vl_run, capsys):
    records = [json.loads(line) for line in (vl_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and "val_loss" in records[-1]
    meta = json.loads(next(vl_run.glob("step_*/meta.json")).read_text())
    assert meta["config"]["vision_config"]["vt_num_hidden_layers"] == 4
    assert main(["train", "--preset", "small-vl", "--steps", "2", "--out", str(vl_run), "--no-progress"]) == 2
    assert "already holds checkpoints: pass --resume" in capsys.readouterr().err


def test_an_interrupted_vision_run_resumes_to_the_unbroken_one(tmp_path, monkeypatch, capsys):
    """Interrupted after step 2 of 4, then `--resume`: every step's loss and the last validation loss are the
    unbroken run's, bitwise; a changed flag is refused as in `k3 train`."""
    from k3.train.vision_trainer import VisionTrainer

    flags = ["--preset", "small-vl", "--steps", "4", "--ckpt-every", "2", "--batch-size", "2", "--eval-every", "2"]
    flags += ["--eval-batches", "1", "--no-progress"]

    def argv(out, *more):
        return ["train", *flags, "--out", str(out), *more]

    assert main(argv(tmp_path / "whole")) == 0
    step = VisionTrainer._step

    def interrupted_after_2(self):
        if self.step == 2:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(VisionTrainer, "_step", interrupted_after_2)
    assert main(argv(tmp_path / "broken")) == 130
    assert "resume with: k3 train " in capsys.readouterr().err
    monkeypatch.setattr(VisionTrainer, "_step", step)
    assert main(argv(tmp_path / "broken", "--lr", "0.001", "--resume")) == 2
    assert "--lr: the run recorded 0.003, now 0.001" in capsys.readouterr().err
    assert main(argv(tmp_path / "broken", "--resume")) == 0
    assert "resumed from" in capsys.readouterr().out

    def logged(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    whole, broken = logged(tmp_path / "whole"), logged(tmp_path / "broken")
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in broken] == [
        (r["step"], r["loss"], r.get("val_loss")) for r in whole
    ]
    assert [p.name for p in (tmp_path / "broken").glob("step_*")] == ["step_00000004"]


REFUSED = [["--expert-optimizer", "adamw"], ["--qat", "mxfp4"], ["--balancer", "fixed"], ["--grad-accum", "2"]]


@pytest.mark.parametrize("flag", [*REFUSED, ["--data", "somewhere"]])
def test_flags_the_image_text_trainer_does_not_apply_are_refused(tmp_path, capsys, flag):
    out = tmp_path / "run"
    assert main(["train", "--preset", "small-vl", "--steps", "1", "--out", str(out), "--no-progress", *flag]) == 2
    assert flag[0] in capsys.readouterr().err and not out.exists()


def test_generate_answers_about_an_image(vl_run, tmp_path, capsys):
    path = tmp_path / "shapes.png"
    example("eval", 0).image.save(path)
    code = main(
        [
            "generate",
            "--model",
            str(vl_run),
            "--image",
            str(path),
            "--temperature",
            "0",
            "--max-tokens",
            "3",
            "How many shapes are there?",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0 and captured.out.startswith("How many shapes are there?")
    # through the engine: streamed, two images, and the same greedy text as the non-streamed request
    streamed = [
        "generate",
        "--model",
        str(vl_run),
        "--image",
        str(path),
        "--temperature",
        "0",
        "--max-tokens",
        "3",
        "--stream",
        "How many shapes are there?",
    ]
    assert main(streamed) == 0 and capsys.readouterr().out == captured.out
    two = ["generate", "--model", str(vl_run), "--image", str(path), "--image", str(path), "--max-tokens", "2", "hi"]
    assert main(two) == 0 and capsys.readouterr().out.startswith("hi")


def test_generate_refuses_bad_images_and_text_models(vl_run, tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    assert main(["generate", "--model", str(vl_run), "--image", str(bad), "hi"]) == 2
    assert "bad.png is not an image Pillow can read" in capsys.readouterr().err
    cmyk16 = tmp_path / "deep.png"
    Image.new("I;16", (28, 28)).save(cmyk16)
    assert main(["generate", "--model", str(vl_run), "--image", str(cmyk16), "hi"]) == 2
    assert "pixel mode 'I;16'" in capsys.readouterr().err
    text_run = tmp_path / "text"
    assert main(["init", "--preset", "tiny", "--out", str(text_run)]) == 0
    capsys.readouterr()
    good = tmp_path / "good.png"
    example("eval", 1).image.save(good)
    assert main(["generate", "--model", str(text_run), "--image", str(good), "hi"]) == 2
    assert "--image needs a vision model" in capsys.readouterr().err


def test_export_writes_the_release_names_and_loads_back(vl_run, tmp_path, capsys):
    from safetensors import safe_open

    from k3.hub import load_pretrained
    from k3.hub.load import load_model_folder

    out = tmp_path / "model"
    assert main(["export", "--ckpt", str(vl_run), "--out", str(out)]) != 0  # a tower needs the multimodal layout
    assert "--prefix language_model" in capsys.readouterr().err
    assert main(["export", "--ckpt", str(vl_run), "--out", str(out), "--prefix", "language_model"]) == 0
    names = set()
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            names |= set(f.keys())
    assert "vision_tower.encoder.blocks.3.wqkv.weight" in names and "mm_projector.proj.2.weight" in names
    assert "language_model.model.embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)
    trained = load_pretrained(vl_run).model.state_dict()
    loaded, plan = load_model_folder(out)
    assert not plan.skipped and all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    text, plan = load_model_folder(out, text_only=True)
    vision_names = [n for n in names if n.startswith(("vision_tower.", "mm_projector."))]
    assert not hasattr(text, "vision_tower") and sorted(plan.skipped) == sorted(vision_names)
