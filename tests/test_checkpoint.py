"""Checkpoints: exact round trip, atomic writes, pruning, and readable errors for bad files."""

import json

import pytest
import torch

from k3 import K3Config, K3Model
from k3.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, step_dirs

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
    with pytest.raises(CheckpointError, match="not a k3-checkpoint-1"):
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
