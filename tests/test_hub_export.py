"""k3 export: a run folder -> a model folder in the release layout -> loaded back with identical logits
(bitwise; with MXFP4 experts, bitwise equal to the model whose experts hold unpack(pack(w))), atomic and
refusing to overwrite; k3 generate and k3 train --init-from take the exported folder."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3.cli import main
from k3.formats.tokenizer import SPECIAL_TOKENS
from k3.hub import ModelFolderError, export_model, load_pretrained, parse_size, read_header
from k3.quant.mx import pack_mxfp4, unpack_mxfp4
from tiny_runs import make_run

IDS = torch.tensor([[3, 70, 101, 9, 250, 44, 12, 0, 200, 17, 5, 66, 31]])


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run folder (k3 init: random weights, byte tokenizer), with non-trivial AttnRes queries and
    router bias so every tensor matters."""
    return make_run(tmp_path_factory.mktemp("run") / "run")


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def headers(folder: Path) -> dict:
    return {n: i for f in sorted(folder.glob("*.safetensors")) for n, i in read_header(f).items()}


@pytest.mark.parametrize("prefix", ["model", "language_model"])
def test_export_round_trip_is_bitwise(run, tmp_path, prefix):
    source = load_pretrained(run).model
    out = export_model(run, tmp_path / "m", shard_size=parse_size("40KB"), prefix=prefix)
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 3 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
    } <= set(names)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    info = headers(out)
    assert index["metadata"]["total_size"] == sum(i.nbytes for i in info.values())
    assert {n: i.file for n, i in info.items()} == index["weight_map"]
    head = "language_model." if prefix == "language_model" else ""
    assert info[head + "model.layers.0.self_attn.A_log"].shape == (128,)
    assert info[head + "lm_head.weight"].shape == (source.config.vocab_size, 64)
    assert all(n.startswith(head + ("model.", "lm_head.")[n.startswith(head + "lm_head")]) for n in info)
    config = json.loads((out / "config.json").read_text())
    arch = "KimiK3ForConditionalGeneration" if prefix == "language_model" else "KimiK3ForCausalLM"
    assert config["architectures"] == [arch] and "quantization_config" not in config["text_config"]
    assert config["text_config"]["dtype"] == "float32" and {i.dtype for i in info.values()} == {"F32"}
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0  # <|endoftext|>
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    loaded = load_pretrained(out)
    assert loaded.kind == "model folder"
    assert torch.equal(logits(loaded.model), logits(source))


def test_mxfp4_export_equals_the_model_with_dequantised_experts(run, tmp_path):
    source = load_pretrained(run).model
    out = export_model(run, tmp_path / "q", quantize="mxfp4", prefix="language_model")
    config = json.loads((out / "config.json").read_text())
    quant = config["text_config"]["quantization_config"]
    assert quant["format"] == "mxfp4-pack-quantized" and quant["quant_method"] == "compressed-tensors"
    assert quant["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert quant["config_groups"]["group_0"]["input_activations"] is None
    assert config["text_config"]["dtype"] == "float32"  # the dense tensors beside the packed uint8 experts
    key = "language_model.model.layers.1.block_sparse_moe.experts.5.w2"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert key + ".weight" not in set(f.keys())
        packed, scale = f.get_tensor(key + ".weight_packed"), f.get_tensor(key + ".weight_scale")
    assert packed.dtype == scale.dtype == torch.uint8 and packed.shape == (32, 16) and scale.shape == (32, 1)

    expected = {}
    for name, t in source.state_dict().items():
        is_expert = ".experts." in name and name.endswith(".weight")
        expected[name] = unpack_mxfp4(*pack_mxfp4(t), dtype=t.dtype) if is_expert else t
    source.load_state_dict(expected)
    loaded = load_pretrained(out).model
    assert torch.equal(logits(loaded), logits(source))
    w2 = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    assert not torch.equal(expected[w2], load_pretrained(run).model.state_dict()[w2])  # MXFP4 did change it


def test_config_dtype_names_the_tensors_written(run):
    """config.json's dtype is the floating dtype that holds most of the written bytes (HF's meaning: what the
    weights are stored in), not the release's bfloat16 copied from K3Config.to_hf()."""
    from k3.hub.export import release_config, release_tensors, weights_dtype

    model = load_pretrained(run).model
    config = model.config
    assert config.to_hf()["text_config"]["dtype"] == "bfloat16"
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        state = {k: (v if k.endswith((".A_log", ".dt_bias")) else v.to(dtype)) for k, v in model.state_dict().items()}
        tensors = release_tensors(state, config, quantize="mxfp4")
        assert weights_dtype(tensors) == dtype  # the fp32 A_log/dt_bias (as in the release) do not decide it
        assert release_config(config, "model", "mxfp4", None, dtype)["text_config"]["dtype"] == name
    # a config read from a file that also names the dtype at the top level (either HF spelling) gets both set
    read = config.from_hf({**config.to_hf(), "torch_dtype": "bfloat16"})
    written = release_config(read, "language_model", None, None, torch.float32)
    assert written["torch_dtype"] == written["text_config"]["dtype"] == "float32"
    with pytest.raises(ModelFolderError, match="no floating-point tensor"):
        weights_dtype({"x": torch.zeros(2, dtype=torch.uint8)})


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("1.5 mb") == 1_500_000
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="shard size 'lots'"):
        parse_size("lots")


def test_cli_export_good_path_refusals_and_corrupt_input(run, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "--ckpt", str(run), "--out", str(out), "--shard-size", "100KB"]) == 0
    assert f"wrote {out}/" in capsys.readouterr().out
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    with pytest.raises(SystemExit) as e:
        main(["export", "--ckpt", str(run), "--out", str(out), "--quantize", "int3"])
    assert e.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "--ckpt", str(run), "--out", str(out), "--sharding", "1GB"])
    assert "unrecognized arguments: --sharding" in capsys.readouterr().err

    assert main(["export", "--ckpt", str(run), "--out", str(out), "--quantize", "mxfp4"]) == 2
    assert "exists and is not empty; choose a new --out or pass --force" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main(["export", "--ckpt", str(out), "--out", str(out), "--force"]) == 2
    assert "holds the source" in capsys.readouterr().err

    assert main(["export", "--ckpt", str(run), "--out", str(out), "--quantize", "mxfp4", "--force"]) == 0
    assert "quantization_config" in json.loads((out / "config.json").read_text())["text_config"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    broken = tmp_path / "broken"
    (broken / "step_00000000").mkdir(parents=True)
    for f in (run / "step_00000000").iterdir():
        (broken / "step_00000000" / f.name).write_bytes(f.read_bytes())
    weights = broken / "step_00000000" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    assert main(["export", "--ckpt", str(broken), "--out", str(tmp_path / "never")]) == 2
    assert "does not match the checksum" in capsys.readouterr().err
    assert not (tmp_path / "never").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert main(["export", "--ckpt", str(tmp_path / "nowhere"), "--out", str(tmp_path / "never")]) == 2
    assert "no such checkpoint, run or model folder" in capsys.readouterr().err


def test_a_failed_write_leaves_nothing(run, tmp_path, monkeypatch):
    import k3.hub.export as export

    def fail(*args, **kwargs):
        raise OSError("disk full")

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("old")
    monkeypatch.setattr(export, "_write_tokenizer", fail)
    with pytest.raises(OSError, match="disk full"):
        export_model(run, tmp_path / "out", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (tmp_path / "out" / "keep.txt").read_text() == "old"
    with pytest.raises(ModelFolderError, match="prefix 'vision'"):
        export_model(run, tmp_path / "x", prefix="vision")


def test_generate_and_init_from_take_the_exported_folder(run, tmp_path, capsys):
    out = export_model(run, tmp_path / "m", shard_size=50_000, prefix="language_model")
    assert main(["generate", "--model", str(out), "--max-tokens", "4", "--temperature", "0", "hello"]) == 0
    via_folder = capsys.readouterr().out
    assert main(["generate", "--ckpt", str(run), "--max-tokens", "4", "--temperature", "0", "hello"]) == 0
    assert capsys.readouterr().out == via_folder and via_folder.startswith("hello")

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"m{i}.py").write_text(f"def f_{i}(x):\n    return x + {i}\n" * 3)
    from k3.train.trainer import TrainArgs, Trainer

    args = TrainArgs(
        out=str(tmp_path / "ft"),
        init_from=str(out),
        data=str(corpus),
        batch_size=2,
        seq_len=16,
        steps=2,
        eval_every=2,
        eval_batches=1,
        warmup=1,
        progress=False,
    )
    trainer = Trainer(args, log=lambda *a: None)
    source = load_pretrained(run).model
    assert trainer.config.hidden_size == 64 and trainer.tokenizer.vocab_size == 256 + len(SPECIAL_TOKENS)
    for (name, a), b in zip(trainer.model.state_dict().items(), source.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert (tmp_path / "ft" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    trainer.train()
    assert (
        main(
            [
                "train",
                "--out",
                str(tmp_path / "ft"),
                "--init-from",
                str(out),
                "--data",
                str(corpus),
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--steps",
                "3",
                "--eval-batches",
                "1",
                "--warmup",
                "1",
                "--resume",
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        main(["train", "--out", str(tmp_path / "ft2"), "--init-from", str(tmp_path / "nowhere"), "--no-progress"]) == 2
    )
    assert "no such checkpoint, run or model folder" in capsys.readouterr().err
