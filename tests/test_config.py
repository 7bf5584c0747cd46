"""K3Config: presets, the derived layer pattern, the official config.json layout, validation."""

import copy
import dataclasses
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


# The released config.json, written from SPEC §1 (and compressed-tensors' serialisation of its weight-only
# MXFP4 scheme), independently of k3.config: the text part k3 builds, and the vision part it carries.
MLA_LAYERS = [*range(4, 93, 4), 93]
RELEASED_QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "group_size": 32,
                "strategy": "group",
                "block_structure": None,
                "dynamic": False,
                "actorder": None,
                "scale_dtype": "torch.uint8",
                "zp_dtype": "torch.uint8",
                "observer": "minmax",
                "observer_kwargs": {},
            },
            "input_activations": None,
            "output_activations": None,
            "format": "mxfp4-pack-quantized",
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*\.mlp\.(gate|up|down)_proj$",
        "re:.*lm_head$",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
}
RELEASED_TEXT_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "dtype": "bfloat16",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "num_hidden_layers": 93,
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "linear_attn_config": {
        "kda_layers": [i for i in range(1, 94) if i not in MLA_LAYERS],
        "full_attn_layers": MLA_LAYERS,
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 33792,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "routed_expert_hidden_size": 3584,
    "moe_intermediate_size": 3072,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
    "attn_res_block_size": 12,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
    # SPEC §1 does not give the tokenizer's special ids; the k3 preset leaves them unset
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "quantization_config": RELEASED_QUANTIZATION,
}
RELEASED_TEXT_PART = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": RELEASED_TEXT_CONFIG,
}
# The released vision part (MoonViT-V2), as published: k3 reads it into VisionConfig and writes it back.
RELEASED_VISION_PART = {
    "vision_config": {
        "_attn_implementation": "flash_attention_2",
        "activation_func": "gelu_pytorch_tanh",
        "attn_bias": False,
        "init_pos_emb_height": 64,
        "init_pos_emb_time": 4,
        "init_pos_emb_width": 64,
        "linear_bias": False,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mlp_type": "mlp2",
        "mm_hidden_size": 1024,
        "mm_projector_type": "patchmergerv2",
        "norm_type": "rmsnorm",
        "patch_embed_proj_bias": False,
        "patch_size": 14,
        "pos_emb_interpolation_mode": "bilinear",
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "qkv_hidden_size": 1536,
        "text_hidden_size": 7168,
        "vt_hidden_size": 1024,
        "vt_intermediate_size": 4096,
        "vt_num_attention_heads": 12,
        "vt_num_hidden_layers": 27,
    },
    "media_placeholder_token_id": 163605,
}


def released(quantization_at: str = "text_config") -> dict:
    """The released config.json (a fresh copy), with quantization_config where it is asked to be."""
    doc = copy.deepcopy({**RELEASED_TEXT_PART, **RELEASED_VISION_PART})
    if quantization_at == "top":
        doc["quantization_config"] = doc["text_config"].pop("quantization_config")
    return doc


def test_k3_preset_is_the_released_config():
    c = K3Config.from_preset("k3")
    assert c.rms_norm_eps == 1e-5
    assert c.to_hf() == {**RELEASED_TEXT_PART, **RELEASED_VISION_PART}  # every field, nested dicts included
    assert K3Config.from_hf(released()) == c


@pytest.mark.parametrize("quantization_at", ["text_config", "top"])
def test_released_config_round_trips_byte_for_byte(tmp_path, quantization_at):
    doc = released(quantization_at)
    (tmp_path / "config.json").write_text(json.dumps(doc, indent=2))
    c = K3Config.from_hf(tmp_path)  # a folder holding config.json
    assert c.quantization_config == RELEASED_QUANTIZATION and c.layer_types.count("kda") == 69
    assert c.to_hf() == doc
    assert json.dumps(c.to_hf(), indent=2) == json.dumps(doc, indent=2)  # same key order too
    c.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == doc


def test_quantization_config_cannot_be_in_both_places():
    doc = released()
    doc["quantization_config"] = RELEASED_QUANTIZATION
    with pytest.raises(ConfigError, match="both at the top level and in text_config"):
        K3Config.from_hf(doc)


def test_unknown_keys_and_k3_switches_survive():
    doc = released()
    doc["text_config"]["linear_attn_config"]["some_future_flag"] = True
    doc["text_config"]["rope_theta"] = 50000.0  # NoPE: inert (module docstring of k3.config)
    doc["text_config"]["rope_scaling"] = {"type": "yarn", "factor": 32.0}
    c = K3Config.from_hf(doc)
    assert c.to_hf() == doc
    changed = dataclasses.replace(c, residual="standard", rms_norm_eps=1e-6)
    back = changed.to_hf()
    assert back.pop("k3") == {"residual": "standard", "mla_impl": "auto"}
    assert back["text_config"]["rms_norm_eps"] == 1e-6 and back["text_config"]["rope_theta"] == 50000.0
    assert K3Config.from_hf(changed.to_hf()) == changed


def test_a_field_the_file_lacks_is_written_only_once_changed():
    flat = copy.deepcopy(RELEASED_TEXT_CONFIG)
    del flat["max_position_embeddings"], flat["num_key_value_heads"], flat["quantization_config"]
    c = K3Config.from_hf(flat)
    assert c.max_position_embeddings == 1048576 and c.to_hf() == flat
    assert dataclasses.replace(c, max_position_embeddings=4096).to_hf()["max_position_embeddings"] == 4096


def test_checkpoints_from_before_the_released_defaults_keep_their_eps():
    """A run folder's meta.json written before: rms_norm_eps 1e-6 explicit, no wrapper keys, "k3" on top."""
    old_text = {
        k: v
        for k, v in K3Config.from_preset("tiny").to_hf()["text_config"].items()
        if k not in ("architectures", "model_type", "dtype", "num_key_value_heads")
    }
    old = {"text_config": {**old_text, "rms_norm_eps": 1e-6}, "k3": {"residual": "attnres", "mla_impl": "auto"}}
    c = K3Config.from_hf(old)
    assert c.rms_norm_eps == 1e-6 and c == K3Config.from_preset("tiny", rms_norm_eps=1e-6)
    assert c.to_hf() == old


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


# Released keys with a value k3 would compute differently: each refused, naming the key and what k3 supports.
ONE_WAY = [
    (dict(moe_router_activation_func="softmax"), r"moe_router_activation_func = 'softmax'.*supported: 'sigmoid'"),
    (dict(scoring_func="softmax"), r"scoring_func = 'softmax'.*supported: 'sigmoid'"),
    (dict(topk_method="greedy"), r"topk_method = 'greedy'.*supported: 'noaux_tc'"),
    (dict(num_nextn_predict_layers=1), r"num_nextn_predict_layers = 1: k3 builds no multi-token.*supported: 0"),
    (dict(moe_layer_freq=2), r"moe_layer_freq = 2.*supported: 1"),
    (dict(num_expert_group=8, topk_group=4), r"num_expert_group = 8: grouped top-k keeping topk_group = 4 of 8"),
    (dict(n_group=8, topk_group=2), r"n_group = 8: grouped top-k .*supported: topk_group = num_expert_group"),
    (dict(num_expert_group=4), r"num_expert_group = 4: grouped top-k keeping topk_group = 1 of 4"),
    (dict(num_key_value_heads=1), r"num_key_value_heads = 1: .*supported: num_attention_heads = 96"),
    (dict(num_experts_per_tok=8), r"num_experts_per_tok = 8: k3 reads num_experts_per_token \(= 16\)"),
    (dict(norm_topk_prob=False), r"norm_topk_prob = False: k3 reads moe_renormalize"),
    (dict(mla_use_nope=False), r"mla_use_nope = False: must be True"),
]


@pytest.mark.parametrize(("change", "message"), ONE_WAY)
def test_released_keys_k3_computes_one_way_are_checked(change, message):
    doc = released()
    doc["text_config"].update(change)
    with pytest.raises(ConfigError, match=message):
        K3Config.from_hf(doc)


# Values of the same keys that change nothing k3 computes: accepted and written back unchanged.
INERT = [
    dict(use_grouped_topk=False, num_expert_group=8, topk_group=2),  # grouping switched off
    dict(num_expert_group=8, topk_group=8),  # every group kept: plain top-k
    dict(scoring_func="sigmoid", norm_topk_prob=True, n_routed_experts=896, num_experts_per_tok=16),
    dict(rope_theta=10000.0, rope_scaling=None),  # NoPE
]


@pytest.mark.parametrize("change", INERT)
def test_released_keys_that_change_nothing_are_kept(change):
    doc = released()
    doc["text_config"].update(change)
    assert K3Config.from_hf(doc).to_hf() == doc


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


# A Kimi Linear config.json as its release writes one (Kimi-Linear-48B-A3B's keys, small sizes): no K3 key in it.
KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "dtype": "bfloat16",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "model_max_length": 4096,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "linear_attn_config": {
        "full_attn_layers": [4],
        "kda_layers": [1, 2, 3],
        "head_dim": 16,
        "num_heads": 2,
        "short_conv_kernel_size": 4,
    },
}


def test_a_partial_config_reads_k3s_extensions_as_off():
    """Issue 31: every K3 key absent means the feature off (Kimi Linear's computation), never K3's value: no
    latent of 3584 in a model 64 wide, no bounded gate, no output gate, no AttnRes, no SiTU."""
    c = K3Config.from_hf(copy.deepcopy(KIMI_LINEAR))
    assert (c.gate_lower_bound, c.use_full_rank_gate, c.mla_use_output_gate) == (None, False, False)
    assert (c.routed_expert_hidden_size, c.latent_moe_use_norm, c.expert_width) == (None, False, 64)
    assert (c.attn_res_block_size, c.residual, c.attn_res_blocks) == (None, "standard", ())
    assert (c.hidden_act, c.q_lora_rank, c.mla_latent_norm_eps, c.family) == ("silu", None, 1e-6, "kimi_linear")
    assert c.max_position_embeddings == 4096  # read from model_max_length, its other spelling
    assert (c.num_experts, c.routed_scaling_factor, c.full_attn_layers) == (8, 2.446, (4,))
    assert c.to_hf() == KIMI_LINEAR and "k3" not in c.to_hf()


def test_a_changed_kimi_linear_config_writes_what_it_needs_to_read_back():
    c = K3Config.from_hf(copy.deepcopy(KIMI_LINEAR))
    bounded = dataclasses.replace(c, gate_lower_bound=-5.0, max_position_embeddings=8192)
    doc = bounded.to_hf()
    assert doc["linear_attn_config"]["gate_lower_bound"] == -5.0
    assert doc["model_max_length"] == 8192 and "max_position_embeddings" not in doc  # the file's spelling
    # a K3 key makes the file K3's, whose code reads MLA's latent norms at rms_norm_eps: the 1e-6 is kept
    assert bounded.family == "k3" and doc["k3"]["mla_latent_norm_eps"] == 1e-6
    assert K3Config.from_hf(doc) == bounded and K3Config.from_hf(doc).to_hf() == doc


def test_keys_the_public_codes_default_differently_must_be_given():
    doc = copy.deepcopy(KIMI_LINEAR)
    del doc["rms_norm_eps"], doc["num_experts"], doc["linear_attn_config"]["num_heads"]
    with pytest.raises(ConfigError, match=r"no rms_norm_eps, linear_attn_config\.num_heads, num_experts") as e:
        K3Config.from_hf(doc)
    assert "1e-6 / 1e-5" in str(e.value) and "docs/checkpoints.md" in str(e.value)
    doc["num_local_experts"] = 8  # transformers' spelling of num_experts, and its copy of num_heads, are read
    doc["linear_num_heads"] = 2
    doc["rms_norm_eps"] = 1e-5
    c = K3Config.from_hf(doc)
    assert (c.num_experts, c.kda_num_heads) == (8, 2) and c.to_hf() == doc
    situ = copy.deepcopy(KIMI_LINEAR) | {"hidden_act": "situ"}
    with pytest.raises(ConfigError, match="no activation_situ_beta, activation_situ_linear_beta"):
        K3Config.from_hf(situ)


def test_transformers_layer_lists_are_read_and_checked():
    doc = copy.deepcopy(KIMI_LINEAR)
    del doc["linear_attn_config"]["full_attn_layers"], doc["linear_attn_config"]["kda_layers"]
    del doc["first_k_dense_replace"]
    doc["layer_types"] = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    doc["mlp_layer_types"] = ["dense", "dense", "sparse", "sparse"]
    c = K3Config.from_hf(doc)
    assert c.layer_types == ("kda", "mla", "kda", "mla") and c.ffn_types == ("dense", "dense", "moe", "moe")
    assert dataclasses.replace(c, first_k_dense_replace=1).to_hf()["mlp_layer_types"] == ["dense"] + ["sparse"] * 3
    doc = copy.deepcopy(KIMI_LINEAR) | {"layer_types": ["full_attention"] + ["linear_attention"] * 3}
    with pytest.raises(ConfigError, match=r"layer_types = .*disagrees with linear_attn_config\.full_attn_layers"):
        K3Config.from_hf(doc)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(attention_bias=True), r"attention_bias = True: k3's MLA projections have no bias"),
        (dict(attention_dropout=0.1), r"attention_dropout = 0.1: k3 applies no attention dropout"),
        (dict(mla_use_nope=False), r"mla_use_nope = False: must be True"),
        (dict(moe_router_activation_func="softmax"), r"moe_router_activation_func = 'softmax'"),
        (dict(latent_moe_use_norm=True), r"latent_moe_use_norm = True: normalises the experts' latent"),
        (dict(k3={"residual": "attnres"}), r"residual = 'attnres': Block AttnRes needs attn_res_block_size"),
    ],
)
def test_kimi_linear_configs_k3_cannot_compute_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        K3Config.from_hf(copy.deepcopy(KIMI_LINEAR) | change)
