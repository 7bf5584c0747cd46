"""Loading a model folder in the release layout, written here from SPEC §1's naming rules alone (not by
k3 export): official config nesting, `language_model.` prefix, shards + index, A_log padded to 128,
MXFP4-packed experts as raw uint8 bytes, vision tensors. Then each way such a folder can be wrong."""

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3 import LLM, K3Config, K3Model, SamplingParams
from k3.formats.tokenizer import SPECIAL_TOKENS, byte_tokenizer
from k3.hub import ModelFolderError, ReadStats, load_model_folder, read_header

# A tiny K3 in the official config.json nesting; layers 1-3 KDA, 4-5 MLA, layer 1 dense.
TEXT = {
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 96,
    "first_k_dense_replace": 1,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "routed_expert_hidden_size": 32,
    "moe_intermediate_size": 64,
    "latent_moe_use_norm": True,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "moe_router_activation_func": "sigmoid",
    "attn_res_block_size": 2,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4, 5],
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
}
QUANT = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "group_size": 32,
                "strategy": "group",
                "scale_dtype": "torch.uint8",
            },
            "input_activations": None,
            "format": "mxfp4-pack-quantized",
        }
    },
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*lm_head$"],
}
CONFIG = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": {**TEXT, "quantization_config": QUANT},
}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The release's packing, decoded by hand: low nibble = even column, bit 3 = sign, scale 2^(s - 127)."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(1).long()
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    value = torch.where(codes >= 8, -mag, mag)
    return value * torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1)


def release_tensors(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the folder's tensors under released names, the same weights under K3Model's names, decoded)."""
    g = torch.Generator().manual_seed(seed)
    t = TEXT
    D, V, H, K = t["hidden_size"], t["vocab_size"], t["linear_attn_config"]["num_heads"], 16
    Hm, nope, rope, v, ql, kvl = 2, 16, 8, 16, 32, 16
    L, I, E = t["routed_expert_hidden_size"], t["moe_intermediate_size"], t["num_experts"]

    def rnd(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    folder, model = {}, {}

    def put(name, tensor, k3_value=None):
        folder["language_model." + name] = tensor
        model[name] = (tensor if k3_value is None else k3_value).double()

    put("model.embed_tokens.weight", rnd(V, D))
    put("lm_head.weight", rnd(V, D))
    for name in ("norm", "output_attn_res_norm"):
        put(f"model.{name}.weight", 1 + rnd(D))
    put("model.output_attn_res_proj.weight", rnd(1, D))
    for i in range(5):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            put(p + name + ".weight", 1 + rnd(D))
        for name in ("self_attention_res_proj", "mlp_res_proj"):
            put(p + name + ".weight", rnd(1, D))
        a = p + "self_attn."
        if i < 3:  # KDA
            for x in "qkv":
                put(a + f"{x}_proj.weight", rnd(H * K, D))
                put(a + f"{x}_conv1d.weight", rnd(H * K, 1, 4, scale=0.5))
            put(a + "f_a_proj.weight", rnd(K, D))
            put(a + "f_b_proj.weight", rnd(H * K, K))
            put(a + "b_proj.weight", rnd(H, D))
            put(a + "g_proj.weight", rnd(H * K, D))
            put(a + "o_norm.weight", 1 + rnd(K))
            put(a + "o_proj.weight", rnd(D, H * K))
            a_log = torch.zeros(128)
            a_log[:H] = torch.rand(H, generator=g) * 2
            put(a + "A_log", a_log, a_log[:H])
            put(a + "dt_bias", rnd(H * K).float())
        else:  # MLA
            put(a + "q_a_proj.weight", rnd(ql, D))
            put(a + "q_a_layernorm.weight", 1 + rnd(ql))
            put(a + "q_b_proj.weight", rnd(Hm * (nope + rope), ql))
            put(a + "kv_a_proj_with_mqa.weight", rnd(kvl + rope, D))
            put(a + "kv_a_layernorm.weight", 1 + rnd(kvl))
            put(a + "kv_b_proj.weight", rnd(Hm * (nope + v), kvl))
            put(a + "g_proj.weight", rnd(Hm * v, D))
            put(a + "o_proj.weight", rnd(D, Hm * v))
        if i == 0:
            put(p + "mlp.gate_proj.weight", rnd(t["intermediate_size"], D))
            put(p + "mlp.up_proj.weight", rnd(t["intermediate_size"], D))
            put(p + "mlp.down_proj.weight", rnd(D, t["intermediate_size"]))
            continue
        m = p + "block_sparse_moe."
        put(m + "gate.weight", rnd(E, D).float())
        put(m + "gate.e_score_correction_bias", rnd(E).float())
        put(m + "routed_expert_down_proj.weight", rnd(L, D))
        put(m + "routed_expert_up_proj.weight", rnd(D, L))
        put(m + "routed_expert_norm.weight", 1 + rnd(L))
        for name, (o, n) in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            put(m + f"shared_experts.{name}.weight", rnd(o, n))
        for e in range(E):
            for w, (o, n) in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
                packed = torch.randint(0, 256, (o, n // 2), generator=g, dtype=torch.uint8)
                scale = torch.randint(120, 126, (o, n // 32), generator=g, dtype=torch.uint8)
                key = f"language_model.{m}experts.{e}.{w}."
                folder[key + "weight_packed"], folder[key + "weight_scale"] = packed, scale
                model[f"{m}experts.{e}.{w}.weight"] = decode_mxfp4(packed, scale)
    folder["vision_tower.patch_embed.proj.weight"] = rnd(8, 3, 2, 2)
    folder["mm_projector.proj.0.weight"] = rnd(D, 8)
    return folder, model


def write_folder(path: Path, tensors: dict[str, torch.Tensor], shards: int = 3, config=CONFIG) -> Path:
    """The release layout: config.json, model-0000i-of-0000n.safetensors, the index."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per : (i + 1) * per]}
        save_file(part, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    byte_tokenizer().save(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folder, model = release_tensors()
    return write_folder(tmp_path_factory.mktemp("release") / "k3", folder), model


def oracle(weights: dict[str, torch.Tensor]) -> K3Model:
    """A K3Model built directly from the weights (already under its names, decoded, in float64)."""
    model = K3Model(K3Config.from_hf(CONFIG)).double()
    model.load_state_dict(weights, strict=True)
    return model.eval()


IDS = torch.tensor([[5, 17, 200, 3, 99, 42, 7, 1, 150, 64, 33]])


def test_release_folder_loads_to_the_model_built_from_its_tensors(release):
    path, weights = release
    stats = ReadStats()
    model, plan = load_model_folder(path, dtype=torch.float64, text_only=True, stats=stats)
    assert sorted(plan.skipped) == ["mm_projector.proj.0.weight", "vision_tower.patch_embed.proj.weight"]
    with torch.no_grad():
        got, want = model(IDS).logits, oracle(weights)(IDS).logits
    assert torch.equal(got, want)
    assert model.config.quantization_config == QUANT and model.config.rms_norm_eps == 1e-5

    # shard by shard: at most the largest tensor (or a packed pair and its decoded weight) alive at once
    infos = {n: i for f in path.glob("*.safetensors") for n, i in read_header(f).items()}
    largest = max(i.nbytes for n, i in infos.items() if not n.startswith(("vision", "mm_")))
    expert = [i.nbytes for n, i in infos.items() if n.endswith((".weight_packed", ".weight_scale"))][:2]
    pair = sum(expert) + 64 * 32 * 8  # packed + scale + the decoded fp64 weight
    assert stats.peak_alive_bytes <= max(largest, pair)
    assert stats.bytes_read >= 20 * stats.peak_alive_bytes  # many times more was read than held
    assert stats.alive_bytes == 0


def test_llm_takes_a_model_folder(release):
    path, weights = release
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(model=str(path), text_only=True, dtype=torch.float64, memory_budget=8 << 20)
    ref = oracle(weights)
    for (name, a), b in zip(llm.engine.model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    out = llm.generate([[5, 17, 200, 3]], greedy)[0].token_ids
    ids = torch.tensor([[5, 17, 200, 3]])
    with torch.no_grad():
        for _ in range(6):  # greedy decoding with the oracle, uncached
            ids = torch.cat([ids, ref(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out == ids[0, 4:].tolist()
    with pytest.raises(ModelFolderError, match=r"vision_tower.*pass text_only=True \(--text-only\)"):
        LLM(str(path))


def variant(tmp_path: Path, change, shards: int = 3, config=CONFIG) -> Path:
    folder, _ = release_tensors()
    change(folder)
    return write_folder(tmp_path / "variant", folder, shards, config)


def digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def expect(path: Path, pattern: str) -> None:
    """The load fails with `pattern`, reads no tensor when the headers already tell, and changes no file."""
    before, stats = digest(path), ReadStats()
    with pytest.raises(ModelFolderError, match=pattern):
        load_model_folder(path, text_only=True, stats=stats)
    assert stats.tensors_read == 0
    assert digest(path) == before


def rename(old: str, new: str):
    return lambda f: f.__setitem__(new, f.pop(old))


Q = "language_model.model.layers.1.self_attn.q_proj.weight"
PACKED = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight_packed"


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (rename(Q, Q.replace("q_proj", "q_projection")), r"cannot place: .*q_projection.*misnamed"),
        (lambda f: f.pop(Q), r"needs but the folder lacks: model\.layers\.1\.self_attn\.q_proj\.weight"),
        (lambda f: f.__setitem__(Q, f[Q][:-1]), r"layers\.1\.self_attn\.q_proj\.weight: shape \[31, 64\], the con"),
        (lambda f: f.__setitem__(PACKED, f[PACKED][:, :-1]), r"w2\.weight_packed: shape \[32, 31\], the packed form"),
        (lambda f: f.pop(PACKED.replace("packed", "scale")), r"w2\.weight_packed: its partner \.weight_scale is"),
        (rename("language_model.lm_head.weight", "lm_head.weight"), r"tensors under both prefixes"),
        (
            lambda f: f.__setitem__(Q.replace("q_proj.weight", "A_log").replace(".1.", ".0."), torch.zeros(64)),
            r"layers\.0\.self_attn\.A_log: shape \[64\], the config gives \[2\] or \[128\] \(padded\)",
        ),
    ],
)
def test_names_and_shapes_are_checked_before_any_read(tmp_path, change, pattern):
    expect(variant(tmp_path, change), pattern)


def test_damaged_folders(tmp_path):
    path = variant(tmp_path, lambda f: None)
    shard = path / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    expect(path, r"model-00002-of-00003\.safetensors is truncated: its header describes \d+ bytes")
    shard.unlink()
    expect(path, r"missing shard shard 2 of 3 \(model-00002-of-00003\.safetensors\)")
    shard.write_bytes(data)

    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    good = json.dumps(index)
    index["weight_map"][Q] = "extra.safetensors"
    index_path.write_text(json.dumps(index))
    expect(path, r"missing file extra\.safetensors: the weight_map .* places 1 tensors there")
    index["weight_map"] = {k: v for k, v in json.loads(good)["weight_map"].items() if "00002" not in v}
    index_path.write_text(json.dumps(index))
    expect(path, r"missing shard shard 2 of 3 .* lists no tensor in shards \[2\] of 3")
    index_path.write_text(good)
    (path / "config.json").rename(path / "config.txt")
    expect(path, r"no config\.json")


def test_padded_a_log_must_be_zero_past_num_heads(tmp_path):
    key = "language_model.model.layers.0.self_attn.A_log"
    path = variant(tmp_path, lambda f: f[key].__setitem__(5, 1.0))
    with pytest.raises(ModelFolderError, match=r"A_log \[128\] holds nonzero values past num_heads = 2"):
        load_model_folder(path, text_only=True)


def test_plain_names_single_file_and_bf16_in_fp32(tmp_path):
    """The text-only prefix in one model.safetensors; bf16 tensors come out exactly in float32."""
    folder, weights = release_tensors(seed=1)
    plain = {k.removeprefix("language_model."): v for k, v in folder.items() if k.startswith("language_model.")}
    path = tmp_path / "plain"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(plain, path / "model.safetensors")
    model, plan = load_model_folder(path)
    assert plan.skipped == [] and next(model.parameters()).dtype == torch.float32
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name].float()), name


def test_mxfp4_experts_stay_packed_bytes_straight_from_the_folder(release, monkeypatch):
    """quantization='mxfp4': the folder's weight_packed/weight_scale bytes land in MXFP4Linear buffers as they
    are (no expert is decoded while loading), and the model computes what the dense-decoded load computes."""
    import k3.quant.mx as mx
    from k3.model.quantization import routed_expert_bytes
    from k3.quant import MXFP4Linear

    path, _ = release
    folder, _ = release_tensors()
    dense, _ = load_model_folder(path, dtype=torch.float64, text_only=True)

    def no_decode(*args, **kwargs):
        raise AssertionError("a packed expert was decoded to a dense weight while loading")

    monkeypatch.setattr(mx, "unpack_mxfp4", no_decode)
    stats = ReadStats()
    packed, plan = load_model_folder(path, dtype=torch.float64, text_only=True, stats=stats, quantization="mxfp4")
    monkeypatch.undo()
    assert not packed.training and len(plan.skipped) == 2
    state = packed.state_dict()
    halves = {k.removeprefix("language_model."): v for k, v in folder.items() if k.endswith(("_packed", "_scale"))}
    assert len(halves) == 4 * 4 * 3 * 2  # 4 MoE layers x 4 experts x w1/w2/w3 x (packed, scale)
    for name, t in halves.items():
        assert state[name].dtype == torch.uint8 and torch.equal(state[name], t), name
    assert not [k for k in state if ".experts." in k and k.endswith(".weight")]
    moe = packed.model.layers[1].block_sparse_moe
    assert all(isinstance(getattr(ex, w), MXFP4Linear) for ex in moe.experts for w in ("w1", "w2", "w3"))
    read = sum(t.numel() * t.element_size() for k, t in folder.items() if k.startswith("language_model."))
    assert stats.bytes_read == read and stats.alive_bytes == 0
    # fp64: 8 bytes per dense expert weight against 17/32 packed
    assert routed_expert_bytes(dense) / routed_expert_bytes(packed) == pytest.approx(256 / 17)
    with torch.no_grad():
        assert torch.equal(packed(IDS).logits, dense(IDS).logits)
    with pytest.raises(ValueError, match=r"quantization 'int8': k3 keeps routed experts dense \(None\) or"):
        load_model_folder(path, text_only=True, quantization="int8")
