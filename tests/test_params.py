"""Parameter, FLOP and cache accounting (k3.model.params) and `k3 params`."""

import json

import pytest

from k3.cli import main
from k3.config import K3Config
from k3.model import K3Model
from k3.model.params import COMPONENTS, UnknownParameterError, classify, count_parameters, param_report

TINY_TEXT = K3Config.from_preset("tiny").to_hf()["text_config"]


@pytest.fixture(scope="module")
def two_layers() -> K3Config:
    """Layer 1: KDA + dense FFN; layer 2: MLA + LatentMoE; one AttnRes block."""
    c = K3Config.from_preset("tiny", num_hidden_layers=2)
    assert c.layer_types == ("kda", "mla") and c.ffn_types == ("dense", "moe")
    return c


def hand_count(c: K3Config) -> dict[str, dict[str, int]]:
    """The two-layer config counted by hand from its fields (tiny: d 64, vocab 512, ...)."""
    d = c.hidden_size
    H, K = c.kda_num_heads, c.kda_head_dim  # KDA: V = K
    w = c.short_conv_kernel_size
    kda = (
        3 * d * H * K  # q_proj, k_proj, v_proj
        + 3 * H * K * w  # q/k/v_conv1d: depthwise, one kernel per channel
        + d * K  # f_a_proj, low rank = head dim
        + K * H * K  # f_b_proj
        + d * H  # b_proj (beta per head)
        + d * H * K  # g_proj, full-rank output gate
        + H  # A_log
        + H * K  # dt_bias
        + K  # o_norm gain, shared by the heads
        + H * K * d  # o_proj
    )
    Hm, qk, v = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    mla = (
        d * c.q_lora_rank  # q_a_proj
        + c.q_lora_rank  # q_a_layernorm
        + c.q_lora_rank * Hm * qk  # q_b_proj
        + d * (c.kv_lora_rank + c.qk_rope_head_dim)  # kv_a_proj_with_mqa: latent + the shared k_pe
        + c.kv_lora_rank  # kv_a_layernorm
        + c.kv_lora_rank * Hm * (c.qk_nope_head_dim + v)  # kv_b_proj: per-head k_nope and v
        + d * Hm * v  # g_proj (output gate)
        + Hm * v * d  # o_proj
    )
    L, I, E = c.routed_expert_hidden_size, c.moe_intermediate_size, c.num_experts
    expert = 3 * L * I  # w1, w3 (I, L) and w2 (L, I), in the latent
    total = {
        "embeddings": c.vocab_size * d,
        "lm_head": d * c.vocab_size,  # untied
        "kda_attention": kda,
        "mla_attention": mla,
        "dense_ffn": 3 * d * c.intermediate_size,  # gate_proj, up_proj, down_proj
        "routed_experts": E * expert,
        "shared_experts": 3 * d * I * c.num_shared_experts,  # one GatedMLP of width I · shared
        "latent_projections": d * L + L * d + L,  # down_proj, up_proj, routed_expert_norm
        "router": E * d,  # gate.weight; e_score_correction_bias is a buffer
        "attn_res": 2 * 2 * (d + d) + (d + d),  # 2 layers × {attention, ffn} × (proj + norm), + the output readout
        "norms": 2 * 2 * d + d,  # input_layernorm, post_attention_layernorm per layer, + model.norm
        "vision_tower": 0,  # a text-only config (tests/test_vision.py counts the tower)
        "mm_projector": 0,
    }
    active = {**total, "routed_experts": c.num_experts_per_token * expert}  # k of E experts run
    return {name: {"total": total[name], "active": active[name]} for name in COMPONENTS}


def test_two_layer_counts_match_the_hand_count(two_layers):
    report = param_report(two_layers, context=100)
    expected = hand_count(two_layers)
    assert report["components"] == expected
    # 2·32768 embeddings + lm_head, 12338 KDA, 10288 MLA, 24576 dense, 24576 routed, 6144 shared,
    # 4128 latent, 512 router, 640 AttnRes, 320 norms
    assert report["total"] == sum(e["total"] for e in expected.values()) == 149_058
    # the routed experts count 2 of their 8 experts: 24576 → 6144
    assert report["active"] == sum(e["active"] for e in expected.values()) == 130_626
    assert report["active_without_embedding"] == report["active"] - 512 * 64
    assert report["total"] == sum(p.numel() for p in K3Model(two_layers).parameters())


def test_two_layer_flops_and_memory_by_hand(two_layers):
    c, ctx = two_layers, 100
    report = param_report(c, context=ctx)
    d, H, K = c.hidden_size, c.kda_num_heads, c.kda_head_dim
    vectors = (  # active parameters that are gains or per-channel vectors, not matmul weights
        H
        + H * K
        + K  # KDA A_log, dt_bias, o_norm
        + c.q_lora_rank
        + c.kv_lora_rank  # MLA q_a_layernorm, kv_a_layernorm
        + c.routed_expert_hidden_size  # routed_expert_norm
        + 2 * 2 * d
        + d  # AttnRes key norms (2 per layer) and output_attn_res_norm
        + 2 * 2 * d
        + d  # input/post-attention norms and model.norm
    )
    matmul = report["active"] - c.vocab_size * d - vectors  # the input embedding is a lookup
    assert report["active_matmul"] == matmul
    mla_attn = 1 * 2 * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * ctx  # 1 MLA layer
    kda_state = 1 * 7 * H * K * K  # 1 KDA layer, 7·H·K·V
    assert report["flops_per_token"] == {
        "matmul": 2 * matmul,
        "mla_attention": mla_attn,
        "kda_state": kda_state,
        "total": 2 * matmul + mla_attn + kda_state,
    }
    cache = report["cache"]
    assert cache["mla_bytes_per_token"] == 1 * (16 + 8) * 2  # kv_lora_rank + qk_rope_head_dim, bf16
    assert cache["mha_bytes_per_token"] == 1 * (2 * 24 + 2 * 16) * 2  # H·qk_head_dim keys + H·v_head_dim values
    assert cache["kda_state_bytes_per_sequence"] == 2 * 16 * 16 * 4 + 3 * (2 * 2 * 16 + 2 * 16) * 2


def test_non_latent_moe_by_hand(two_layers):
    c = two_layers
    report = param_report(c, context=0)
    plain = report["non_latent_moe"]
    d, L, I, E, k = (
        c.hidden_size,
        c.routed_expert_hidden_size,
        c.moe_intermediate_size,
        c.num_experts,
        c.num_experts_per_token,
    )
    full_expert, latent_expert = 3 * d * I, 3 * L * I
    latent_path = 2 * d * L + L  # down, up projections and the latent norm, gone without a latent
    assert plain["total"] == report["total"] - E * latent_expert - latent_path + E * full_expert
    assert plain["active"] == report["active"] - k * latent_expert - latent_path + k * full_expert
    assert plain["flops_per_token"]["matmul"] == report["flops_per_token"]["matmul"] + 2 * (
        k * full_expert - k * latent_expert - 2 * d * L
    )
    assert plain["total_saved"] == plain["total"] - report["total"] > 0


@pytest.mark.parametrize(
    "config",
    [
        K3Config.from_preset("tiny"),
        K3Config.from_preset("small"),
        K3Config.from_preset("tiny", residual="standard", first_k_dense_replace=0),
        K3Config.from_preset(
            "tiny",
            q_lora_rank=None,
            use_full_rank_gate=False,
            latent_moe_use_norm=False,
            num_shared_experts=0,
            tie_word_embeddings=True,
        ),
    ],
    ids=["tiny", "small", "standard-residual", "other-switches"],
)
def test_every_parameter_lands_in_exactly_one_component(config):
    model = K3Model(config)
    counted = dict.fromkeys(COMPONENTS, 0)
    for name, p in model.named_parameters():
        component, _ = classify(name, config)  # raises unless exactly one rule matches
        counted[component] += p.numel()
    assert sum(counted.values()) == sum(p.numel() for p in model.parameters())
    counts = count_parameters(config)
    assert {name: c["total"] for name, c in counts.items()} == counted
    assert "e_score_correction_bias" not in " ".join(n for n, _ in model.named_parameters())


def test_tied_lm_head_counts_once_but_still_costs_flops():
    tied = K3Config.from_preset("tiny", tie_word_embeddings=True)
    untied = K3Config.from_preset("tiny")
    a, b = param_report(tied, context=0), param_report(untied, context=0)
    vd = untied.vocab_size * untied.hidden_size
    assert b["total"] - a["total"] == vd and a["components"]["lm_head"]["total"] == 0
    assert a["active_matmul"] == b["active_matmul"]


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.bogus.weight",  # not a KDA parameter
        "model.layers.0.self_attn.kv_b_proj.weight",  # an MLA parameter in a KDA layer
        "model.layers.0.block_sparse_moe.gate.weight",  # a MoE parameter in the dense layer
        "model.layers.1.mlp.up_proj.weight",  # a dense FFN parameter in a MoE layer
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",  # a buffer, never a parameter
        "model.layers.7.input_layernorm.weight",  # past the last layer
        "language_model.lm_head.weight",  # the multimodal prefix is not a K3Model name
    ],
)
def test_an_unknown_name_fails_loudly(two_layers, name):
    with pytest.raises(UnknownParameterError, match=r"parameter|layer"):
        classify(name, two_layers)


def test_cli_params_json(capsys):
    assert main(["params", "--preset", "tiny", "--json", "--context", "64"]) == 0
    report = json.loads(capsys.readouterr().out)  # exactly one JSON object
    assert isinstance(report["total"], int) and isinstance(report["active"], int)
    assert 0 < report["active"] < report["total"]
    assert report == param_report(K3Config.from_preset("tiny"), context=64)


def test_cli_params_table(capsys):
    assert main(["params", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    total = param_report(K3Config.from_preset("tiny"))["total"]
    assert "component" in out and "routed_experts" in out and f"{total:,}" in out
    assert "FLOPs per token" in out and "MHA cache" in out and "KDA state" in out and "full width" in out


def test_cli_params_reads_the_official_layout(tmp_path, capsys):
    config = K3Config.from_preset("tiny", num_hidden_layers=2)
    config.save(tmp_path / "config.json")
    assert main(["params", "--config", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == param_report(config)["total"]


def test_cli_params_missing_config_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope" / "config.json"
    assert main(["params", "--config", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "cannot read a config" in captured.err and str(missing) in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "cannot read a config"),
        ('{"text_config": {"hidden_size": -1}}', "config.json has no num_hidden_layers"),  # issue 31: no guessing
        (json.dumps({"text_config": {**TINY_TEXT, "hidden_size": -1}}), "hidden_size = -1"),
        ('{"text_config": {"linear_attn_config": [4]}}', "not a K3 config.json"),
    ],
)
def test_cli_params_bad_config_exits_2(tmp_path, capsys, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    assert main(["params", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_full_k3_preset():
    """The released configuration, built on the meta device (~30 s): SPEC §1's 2.8T total."""
    config = K3Config.from_preset("k3")
    report = param_report(config)
    assert report["layers"]["kda"] == 69 and report["layers"]["mla"] == 24
    assert report["layers"]["mla_layer_numbers"][-2:] == [92, 93]
    assert report["layers"]["attn_res_blocks"] == 8
    assert abs(report["total"] - 2.8e12) / 2.8e12 < 0.03
    assert report["components"]["routed_experts"]["total"] == 92 * 896 * 3 * 3584 * 3072
    assert report["components"]["routed_experts"]["active"] == 92 * 16 * 3 * 3584 * 3072
    assert report["cache"]["mla_bytes_per_token"] == 24 * 576 * 2
    assert report["non_latent_moe"]["total"] > report["total"]
