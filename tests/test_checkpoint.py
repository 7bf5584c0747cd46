"""Checkpoints: exact round trip, atomic writes, pruning, and readable errors for bad files."""

import hashlib
import json
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3 import K3Config, K3Model
from k3.formats.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    load_checkpoint,
    save_checkpoint,
    step_dirs,
    write_meta,
)
from k3.model.names import is_legacy_key, legacy_key
from k3.train.optim import build_optimizer

CONFIG = K3Config.from_preset("tiny")


def trained_pair():
    torch.manual_seed(0)
    model = K3Model(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    return model, opt


def test_round_trip_is_exact(tmp_path):
    model, opt = trained_pair()
    path = save_checkpoint(tmp_path, 5, model, opt, CONFIG, {"position": 42}, extra={"hist": torch.arange(3.0)})
    assert path.name == "step_00000005" and not any(p.name.startswith(".") for p in tmp_path.iterdir())
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 5 and ckpt.state["position"] == 42 and ckpt.config == CONFIG
    model2 = K3Model(CONFIG)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    ckpt.load_model(model2)
    ckpt.load_optimizer(opt2, model2)
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[p2][key])
    assert torch.equal(ckpt.tensors("extra.safetensors")["hist"], torch.arange(3.0))


def test_keeps_the_last_k_and_ignores_unfinished_writes(tmp_path):
    model, opt = trained_pair()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, opt, CONFIG, {"position": step}, keep_last=2)
    (tmp_path / ".step_00000009.tmp").mkdir()  # a write that crashed before its rename
    (tmp_path / "step_00000007").mkdir()  # a folder with no meta.json is not a checkpoint
    assert [p.name for p in step_dirs(tmp_path)] == ["step_00000004", "step_00000005"]
    with pytest.warns(CheckpointWarning, match=r"loading the older step_00000005 .*step_00000007 has no meta.json"):
        assert load_checkpoint(tmp_path).step == 5


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_files_are_detected(tmp_path, damage):
    model, opt = trained_pair()
    path = save_checkpoint(tmp_path, 1, model, opt, CONFIG, {"position": 0})
    target = path / "model.safetensors"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match=r"checksum|missing"):
        load_checkpoint(tmp_path)


def test_bad_meta_and_mismatched_model(tmp_path):
    model, opt = trained_pair()
    path = save_checkpoint(tmp_path, 1, model, opt, CONFIG, {"position": 0})
    meta = (path / "meta.json").read_text()
    (path / "meta.json").write_text(meta[:50])
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(path)
    (path / "meta.json").write_text(json.dumps({**json.loads(meta), "format": "other"}))
    with pytest.raises(CheckpointError, match="not a k3 checkpoint"):
        load_checkpoint(path)
    (path / "meta.json").write_text(meta)
    other = K3Model(K3Config.from_preset("tiny", num_hidden_layers=3))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_checkpoint(path).load_model(other)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        load_checkpoint(tmp_path / "empty")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("model.layers.0.attention_res_proj.weight", "model.layers.0.self_attention_res_proj.weight"),
        ("model.layers.12.attention_res_norm.weight", "model.layers.12.self_attention_res_norm.weight"),
        ("model.layers.3.ffn_res_proj.weight", "model.layers.3.mlp_res_proj.weight"),
        ("language_model.model.layers.92.ffn_res_norm.weight", "language_model.model.layers.92.mlp_res_norm.weight"),
        ("model.layers.2.ffn_res_proj.weight::exp_avg", "model.layers.2.mlp_res_proj.weight::exp_avg"),
        # already released names, and look-alikes that are not the per-layer AttnRes modules: unchanged
        ("model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_proj.weight"),
        ("model.layers.0.mlp_res_norm.weight", "model.layers.0.mlp_res_norm.weight"),
        ("model.output_attn_res_proj.weight", "model.output_attn_res_proj.weight"),
        ("model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"),
    ],
)
def test_legacy_key(old, new):
    assert legacy_key(old) == new
    assert is_legacy_key(old) == (old != new)


def as_pre_release(path):
    """Rewrite a checkpoint in place as k3 wrote it before the rename: old AttnRes names in the model and
    optimiser files and in meta.json's groups and scalars, checksums updated to match."""
    old = {"self_attention_res": "attention_res", "mlp_res": "ffn_res"}

    def back(key: str) -> str:
        for new, was in old.items():
            key = key.replace(f".{new}_", f".{was}_")
        return key

    for name in ("model.safetensors", "optimizer.safetensors"):
        tensors = load_file(path / name)
        save_file({back(k): v for k, v in tensors.items()}, path / name, metadata={"format": "pt"})
    meta = json.loads((path / "meta.json").read_text())
    opt = meta["optimizer"]
    opt["groups"] = [{**g, "params": [back(n) for n in g["params"]]} for g in opt["groups"]]
    opt["scalars"] = {back(k): v for k, v in opt["scalars"].items()}
    meta["sha256"] = {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in meta["sha256"]}
    write_meta(path, meta)
    assert any(is_legacy_key(k) for k in load_file(path / "model.safetensors"))


def test_checkpoints_with_pre_release_names_load_and_resume(tmp_path):
    torch.manual_seed(0)
    model = K3Model(CONFIG).double()
    opt = build_optimizer(model, lr=1e-2)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16))
    for _ in range(2):  # two steps: the AttnRes queries leave zero, the optimiser has moments and a step count
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    path = save_checkpoint(tmp_path, 2, model, opt, CONFIG, {"position": 0})
    as_pre_release(path)

    ckpt = load_checkpoint(tmp_path)
    model2 = K3Model(CONFIG).double()
    opt2 = build_optimizer(model2, lr=1e-2)
    with pytest.warns(FutureWarning, match="pre-release AttnRes names") as warned:
        ckpt.load_model(model2)
        ckpt.load_optimizer(opt2, model2)
    assert len(warned) == 1  # one note per checkpoint, not one per file
    assert any(model2.state_dict()[k].abs().sum() > 0 for k in model2.state_dict() if "_res_proj" in k)
    with torch.no_grad():
        assert torch.equal(model2(ids).logits, model(ids).logits)
    for m, o in ((model, opt), (model2, opt2)):  # resume: one more step from each
        o.zero_grad()
        m(ids, labels=ids).loss.backward()
        o.step()
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def test_current_names_load_without_a_warning(tmp_path):
    model, opt = trained_pair()
    save_checkpoint(tmp_path, 1, model, opt, CONFIG, {"position": 0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_checkpoint(tmp_path).load_model(K3Model(CONFIG))


def test_old_and_new_name_of_one_tensor_is_an_error(tmp_path):
    model, opt = trained_pair()
    path = save_checkpoint(tmp_path, 1, model, opt, CONFIG, {"position": 0})
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.ffn_res_norm.weight"] = tensors["model.layers.0.mlp_res_norm.weight"].clone()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="both the old and the released name"):
        load_checkpoint(path, check_digests=False).load_model(K3Model(CONFIG))


def test_a_hand_edited_meta_json_is_refused(tmp_path):
    """Changing a config field in meta.json (its tensors' checksums still match) would change what the
    model computes without a word: meta.json's own checksum catches it."""
    model, opt = trained_pair()
    path = save_checkpoint(tmp_path, 1, model, opt, CONFIG, {"position": 0})
    meta = json.loads((path / "meta.json").read_text())
    assert len(meta["meta_sha256"]) == 64
    load_checkpoint(path)
    meta["config"]["text_config"]["rms_norm_eps"] = 1e-3
    (path / "meta.json").write_text(json.dumps(meta, indent=4))
    with pytest.raises(CheckpointError, match=r"does not match its own checksum \(meta_sha256\)"):
        load_checkpoint(path)
    del meta["meta_sha256"]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="has no meta_sha256"):
        load_checkpoint(path)
    write_meta(path, meta)  # the way to change it on purpose
    assert load_checkpoint(path).config.rms_norm_eps == 1e-3


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: [m], "a JSON list, not the object"),
        (lambda m: {k: v for k, v in m.items() if k != "sha256"}, "sha256 must be a JSON object"),
        (lambda m: {**m, "sha256": {}}, "sha256 lacks a checksum for model.safetensors"),
        (lambda m: {**m, "step": "3"}, "step must be a non-negative integer, got '3'"),
        (lambda m: {**m, "state": {}}, "state.position must be a non-negative integer, got None"),
        (
            lambda m: {**m, "state": {"position": 0, "tokenizer": "../../elsewhere/tokenizer.json"}},
            "points outside the run folder",
        ),
        (
            lambda m: {**m, "state": {"position": 0, "tokenizer": "/etc/tokenizer.json"}},
            "points outside the run folder",
        ),
    ],
)
def test_meta_json_of_the_wrong_shape_is_a_checkpoint_error(tmp_path, edit, message):
    model, opt = trained_pair()
    path = save_checkpoint(tmp_path, 1, model, opt, CONFIG, {"position": 0})
    meta = edit(json.loads((path / "meta.json").read_text()))
    if isinstance(meta, dict):
        write_meta(path, meta)  # a correct self-checksum: only the shape is wrong
    else:
        (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_checkpoint(path)


def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one_and_says_so(tmp_path):
    model, opt = trained_pair()
    for step in (2, 4):
        save_checkpoint(tmp_path, step, model, opt, CONFIG, {"position": step})
    newest = tmp_path / "step_00000004"
    (newest / "meta.json").write_text('{"format": ')  # a torn write
    messages = []
    ckpt = load_checkpoint(tmp_path, log=messages.append)
    assert ckpt.step == 2 and ckpt.state["position"] == 2
    assert len(messages) == 1 and "loading the older step_00000002 (step 2)" in messages[0]
    assert "step_00000004/meta.json is not valid JSON" in messages[0]
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(newest)  # a step folder named explicitly does not fall back
    (newest / "meta.json").unlink()
    messages.clear()
    assert load_checkpoint(tmp_path, log=messages.append).step == 2
    assert "step_00000004 has no meta.json" in messages[0]
    (tmp_path / "step_00000002" / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"step_00000004 has no meta\.json"):  # none usable: the newest's error
        load_checkpoint(tmp_path)


def test_save_refuses_a_tokenizer_path_outside_the_run(tmp_path):
    model, opt = trained_pair()
    with pytest.raises(CheckpointError, match="points outside the run folder"):
        save_checkpoint(tmp_path, 1, model, opt, CONFIG, {"position": 0, "tokenizer": "../tokenizer.json"})
    assert not list(tmp_path.iterdir())
