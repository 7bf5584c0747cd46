"""K3Config: presets, the derived layer pattern, the official config.json layout, validation."""

import json

import pytest

from k3.config import ConfigError, K3Config


def test_released_layer_pattern():
    c = K3Config.from_preset("k3")
    assert c.layer_types.count("kda") == 69 and c.layer_types.count("mla") == 24
    assert [i + 1 for i in c.mla_layers] == [*range(4, 93, 4), 93]
    assert c.ffn_types[0] == "dense" and set(c.ffn_types[1:]) == {"moe"}
    assert len(c.attn_res_blocks) == 8 and c.attn_res_blocks[-1] == (84, 93)  # 7 × 12 + a 9-layer tail


@pytest.mark.parametrize("name", ["small", "tiny"])
def test_small_presets_keep_the_structure(name):
    c = K3Config.from_preset(name)
    kinds = c.layer_types
    assert kinds[-1] == kinds[-2] == "mla"  # the last macrocycle's MLA plus the closing one
    assert kinds[:3] == ("kda",) * 3 and kinds[3] == "mla"
    assert c.ffn_types[0] == "dense" and c.num_shared_experts >= 1 and c.routed_expert_hidden_size < c.hidden_size
    assert len(c.attn_res_blocks) >= 2


def official_layout() -> dict:
    """A config.json in the released nesting, with keys k3 does not interpret."""
    text = K3Config.from_preset("k3").to_hf()
    text.pop("k3")
    inner = text.pop("text_config")
    inner["model_type"] = "kimi_k3_text"
    inner["linear_attn_config"]["some_future_flag"] = True
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "torch_dtype": "bfloat16",
        "text_config": inner,
        "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27},
        "quantization_config": {"format": "mxfp4-pack-quantized", "config_groups": {"group_0": {"weights": {
            "num_bits": 4, "group_size": 32}}}},
    }  # fmt: skip


def test_official_layout_round_trip(tmp_path):
    layout = official_layout()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(layout))
    c = K3Config.from_hf(tmp_path)  # a folder holding config.json
    assert c.layer_types.count("kda") == 69 and [i + 1 for i in c.mla_layers][-2:] == [92, 93]
    assert c.quantization_config["format"] == "mxfp4-pack-quantized"
    back = c.to_hf()
    assert back.pop("k3") == {"residual": "attnres", "mla_impl": "auto"}
    assert back == layout  # nothing lost, unknown keys included
    assert K3Config.from_hf(c.to_hf()) == c


@pytest.mark.parametrize("name", ["k3", "small", "tiny"])
def test_preset_round_trip(name):
    c = K3Config.from_preset(name, residual="standard", mla_impl="absorbed")
    assert K3Config.from_hf(c.to_hf()) == c
    assert K3Config.from_hf(json.loads(json.dumps(c.to_hf()))).to_hf() == c.to_hf()


def test_flat_layout_without_text_config():
    flat = K3Config.from_preset("tiny").to_hf()["text_config"]
    c = K3Config.from_hf(flat)
    assert c == K3Config.from_preset("tiny")
    assert "text_config" not in c.to_hf()


BAD = [
    (dict(num_experts_per_token=17, num_experts=16), r"num_experts_per_token = 17: must be at most num_experts = 16"),
    (dict(hidden_size=0), r"hidden_size = 0: must be a positive integer"),
    (dict(gate_lower_bound=-6.0), r"gate_lower_bound = -6.0: must be in \[-5, 0\)"),
    (dict(hidden_act="gelu"), r"hidden_act = 'gelu'"),
    (dict(residual="sum"), r"residual = 'sum'"),
    (dict(mla_impl="flash"), r"mla_impl = 'flash'"),
    (dict(full_attn_layers=(4, 2)), r"full_attn_layers = \(4, 2\): must be strictly increasing"),
    (dict(full_attn_layers=(0, 4)), r"in \[1, 5\]"),
    (dict(first_k_dense_replace=9), r"first_k_dense_replace = 9: must be at most num_hidden_layers = 5"),
    (dict(q_lora_rank=-1), r"q_lora_rank = -1"),
    (dict(mla_use_nope=False), r"mla_use_nope = False"),
    (dict(num_hidden_layers=2.5), r"num_hidden_layers = 2.5: must be a positive integer"),
]


@pytest.mark.parametrize(("change", "message"), BAD)
def test_invalid_configs_say_which_field(change, message):
    with pytest.raises(ConfigError, match=message):
        K3Config.from_preset("tiny", **change)


def test_bad_files_and_layouts(tmp_path):
    with pytest.raises(ConfigError, match="cannot read a config"):
        K3Config.from_hf(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read a config"):
        K3Config.from_hf(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        K3Config.from_preset("huge")
    layout = K3Config.from_preset("tiny").to_hf()
    layout["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2]
    with pytest.raises(ConfigError, match="kda_layers"):
        K3Config.from_hf(layout)


def test_describe_lists_every_layer():
    lines = K3Config.from_preset("tiny").describe().splitlines()
    assert len(lines) == 5 and "MLA" in lines[3] and "dense" in lines[0]
