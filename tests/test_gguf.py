"""k3 export --format gguf, read back with the gguf package's reader: the metadata, tensor names, shapes and
dtypes llama.cpp's kimi-k3 loader asks for (src/models/kimi-k3.cpp), every tensor's values against the k3
model's, MXFP4 blocks bit-exact against k3's packing, the tokenizer (tokens, types, merges, and a pre-tokenizer
type whose split, re-derived here from llama.cpp's src/unicode.cpp, equals k3's on tricky text), the chat
template against k3.chat, and the errors. tests/test_gguf_llama_cpp.py runs the files in llama.cpp itself."""

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_models import TRICKY, trained_tokenizer  # noqa: E402
from k3 import K3Config, K3Model  # noqa: E402
from k3.chat import render_text  # noqa: E402
from k3.cli import main  # noqa: E402
from k3.formats.tokenizer import SPECIAL_TOKENS, K3Tokenizer, byte_tokenizer  # noqa: E402
from k3.hub import ModelFolderError, load_pretrained  # noqa: E402
from k3.hub.gguf import export_gguf, gguf_tensors, write_gguf  # noqa: E402
from k3.hub.gguf_vocab import PRE_TOKENIZER, chat_template, gguf_vocab  # noqa: E402
from k3.quant.mx import pack_mxfp4, unpack_mxfp4  # noqa: E402
from tiny_runs import make_run  # noqa: E402

# llama.cpp's \s (src/unicode-data.cpp, unicode_set_whitespace)
WHITESPACE = {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029}
WHITESPACE |= {0x202F, 0x205F, 0x3000}


def llama_gpt2_split(text: str) -> list[str]:
    """llama.cpp's hand-written GPT-2 split (unicode_regex_split_custom_gpt2, what its gpt2-regex pre-tokenizer
    types run), re-derived: at each position, a contraction; else an optional space and a run of letters,
    of digits, or of other non-space characters; else a whitespace run that leaves its last character to
    the next word unless it ends the text."""
    n = len(text)

    def kind(i: int) -> str | None:  # None past the end
        if i >= n:
            return None
        if ord(text[i]) in WHITESPACE:
            return "space"
        return {"L": "letter", "N": "number"}.get(unicodedata.category(text[i])[0], "other")

    pieces, start, pos = [], 0, 0
    while pos < n:
        c = text[pos]
        if c == "'" and pos + 1 < n and (text[pos + 1] in "stmd" or text[pos + 1 : pos + 3] in ("re", "ve", "ll")):
            pos += 2 if text[pos + 1] in "stmd" else 3
        else:
            j = pos + 1 if c == " " else pos
            if kind(j) in ("letter", "number", "other"):
                run = kind(j)
                pos = j
                while kind(pos) == run:
                    pos += 1
            else:
                k = 0
                while kind(pos + k) == "space":
                    k += 1
                pos += k - 1 if k > 1 and pos + k < n else max(k, 1)
        pieces.append(text[start:pos])
        start = pos
    return pieces


def byte_level(piece: str) -> str:
    """GPT-2's bytes -> printable characters map: printable Latin-1 bytes stand for themselves, the other
    bytes, in order, for U+0100 onward."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return "".join(table[b] for b in piece.encode())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("run") / "run")


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    out = {}
    for outtype in ("f32", "bf16", "mxfp4"):
        out[outtype] = folder / f"tiny-{outtype}.gguf"
        args = ["export", "--ckpt", str(run), "--out", str(out[outtype]), "--format", "gguf", "--outtype", outtype]
        assert main(args) == 0
    return out


def fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {name: f.contents() for name, f in reader.fields.items()}


def tensors(path: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def expected_shapes(c: K3Config) -> dict[str, tuple[int, ...]]:
    """What kimi-k3.cpp's load_arch_tensors asks for, in GGUF order (fastest axis first)."""
    d, V, Hd, H = c.hidden_size, c.vocab_size, c.kda_head_dim, c.num_attention_heads
    inner, latent, ff_exp, E = H * Hd, c.routed_expert_hidden_size, c.moe_intermediate_size, c.num_experts
    nope, rope, vd, rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    shapes = {
        "token_embd.weight": (d, V),
        "output_norm.weight": (d,),
        "output.weight": (d, V),
        "output_res_score.weight": (d,),
    }
    for i, (kind, ffn) in enumerate(zip(c.layer_types, c.ffn_types, strict=True)):
        b = f"blk.{i}."
        layer = {"attn_norm.weight": (d,), "ffn_norm.weight": (d,), "attn_res_score.weight": (d,)}
        layer["ffn_res_score.weight"] = (d,)
        if kind == "kda":
            for x in "qkv":
                layer[f"ssm_conv1d_{x}.weight"] = (c.short_conv_kernel_size, 1, inner, 1)
                layer[f"attn_{x}.weight"] = (d, inner)
            layer |= {"ssm_f_a.weight": (d, Hd), "ssm_f_b.weight": (Hd, inner), "ssm_beta.weight": (d, H)}
            layer |= {"ssm_a": (H,), "ssm_dt.bias": (inner,), "ssm_g.weight": (d, inner)}
            layer |= {"ssm_norm.weight": (Hd,), "attn_output.weight": (inner, d)}
        else:
            layer |= {"attn_q_a_norm.weight": (c.q_lora_rank,), "attn_kv_a_norm.weight": (rank,)}
            layer |= {"attn_q_a.weight": (d, c.q_lora_rank), "attn_q_b.weight": (c.q_lora_rank, H * (nope + rope))}
            layer |= {"attn_kv_a_mqa.weight": (d, rank + rope), "attn_k_b.weight": (nope, rank, H)}
            layer |= {"attn_v_b.weight": (rank, vd, H), "attn_gate.weight": (d, H * vd)}
            layer["attn_output.weight"] = (H * vd, d)
        if ffn == "dense":
            n_ff = c.intermediate_size
            layer |= {"ffn_gate.weight": (d, n_ff), "ffn_down.weight": (n_ff, d), "ffn_up.weight": (d, n_ff)}
        else:
            shared = ff_exp * c.num_shared_experts
            layer |= {"ffn_gate_inp.weight": (d, E), "exp_probs_b.bias": (E,)}
            layer |= {"ffn_gate_exps.weight": (latent, ff_exp, E), "ffn_up_exps.weight": (latent, ff_exp, E)}
            layer |= {"ffn_down_exps.weight": (ff_exp, latent, E), "ffn_routed_down.weight": (d, latent)}
            layer |= {"ffn_routed_up.weight": (latent, d), "ffn_routed_norm.weight": (latent,)}
            layer |= {"ffn_gate_shexp.weight": (d, shared), "ffn_up_shexp.weight": (d, shared)}
            layer["ffn_down_shexp.weight"] = (shared, d)
        shapes |= {b + k: v for k, v in layer.items()}
    return shapes


def test_metadata_is_what_the_kimi_k3_loader_reads(run, exported):
    c = load_pretrained(run).config
    f = fields(exported["f32"])
    k = {key.removeprefix("kimi-k3."): v for key, v in f.items() if key.startswith("kimi-k3.")}
    assert f["general.architecture"] == "kimi-k3"
    assert f["general.file_type"] == 0 and fields(exported["bf16"])["general.file_type"] == 32
    assert fields(exported["mxfp4"])["general.file_type"] == 38
    assert k["block_count"] == 5 and k["embedding_length"] == 64 and k["feed_forward_length"] == 128
    assert k["attention.head_count"] == 2 and k["attention.head_count_kv"] == [0, 0, 0, 1, 1]
    assert k["attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert (k["attention.q_lora_rank"], k["attention.kv_lora_rank"]) == (32, 16)
    assert (k["attention.key_length"], k["attention.value_length"]) == (16 + 8, 16)
    assert (k["attention.key_length_mla"], k["attention.value_length_mla"], k["rope.dimension_count"]) == (24, 16, 8)
    assert (k["ssm.conv_kernel"], k["kda.head_dim"], k["kda.gate_lower_bound"]) == (4, 16, -5.0)
    assert (k["expert_count"], k["expert_used_count"], k["expert_shared_count"]) == (8, 2, 1)
    assert (k["expert_feed_forward_length"], k["expert_latent_length"], k["leading_dense_block_count"]) == (32, 32, 1)
    assert (k["expert_weights_scale"], k["expert_weights_norm"], k["expert_gating_func"]) == (1.0, True, 2)
    assert (k["activation.situ_beta"], k["activation.situ_linear_beta"]) == (4.0, 25.0)
    assert k["attn_res.block_size"] == c.attn_res_block_size == 2
    reader = gguf.GGUFReader(exported["f32"])  # the loader asks each key for one GGUF type
    types = {name: fl.types for name, fl in reader.fields.items()}
    V = gguf.GGUFValueType
    assert types["kimi-k3.block_count"] == [V.UINT32] and types["kimi-k3.expert_weights_norm"] == [V.BOOL]
    assert types["kimi-k3.attention.head_count_kv"] == [V.ARRAY, V.UINT32]
    assert types["kimi-k3.activation.situ_beta"] == [V.FLOAT32]


def test_tensor_names_shapes_and_dtypes(run, exported):
    want = expected_shapes(load_pretrained(run).config)
    for outtype, path in exported.items():
        got = tensors(path)
        assert sorted(got) == sorted(want), outtype
        for name, t in got.items():
            assert tuple(int(x) for x in t.shape) == want[name], name
            kept_f32 = len(want[name]) == 1 or "conv1d" in name or name.endswith("ffn_gate_inp.weight")
            expected = "F32" if kept_f32 or outtype == "f32" else "BF16"
            if outtype == "mxfp4" and "_exps." in name:
                expected = "MXFP4"
            assert t.tensor_type.name == expected, (outtype, name)


def as_torch(t) -> torch.Tensor:
    """A GGUF tensor as torch, in torch's axis order (slowest first)."""
    data = np.asarray(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        data = torch.from_numpy(data.copy()).view(torch.bfloat16).float().numpy()
    elif t.tensor_type not in (gguf.GGMLQuantizationType.F32,):
        data = gguf.quants.dequantize(data, t.tensor_type)
    return torch.from_numpy(np.array(data)).reshape([int(x) for x in reversed(t.shape)])


def test_f32_values_are_the_models(run, exported):
    state = load_pretrained(run).model.state_dict()
    got = {n: as_torch(t) for n, t in tensors(exported["f32"]).items()}
    L = "model.layers."
    assert torch.equal(got["token_embd.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(got["output.weight"], state["lm_head.weight"])
    assert torch.equal(got["blk.0.ssm_conv1d_k.weight"].flatten(), state[L + "0.self_attn.k_conv1d.weight"].flatten())
    assert torch.equal(got["blk.2.ssm_a"], (-torch.exp(state[L + "2.self_attn.A_log"].double())).float())
    assert torch.equal(got["blk.2.ssm_dt.bias"], state[L + "2.self_attn.dt_bias"])
    assert torch.equal(got["blk.0.ssm_g.weight"], state[L + "0.self_attn.g_proj.weight"])
    assert torch.equal(got["blk.3.attn_gate.weight"], state[L + "3.self_attn.g_proj.weight"])
    assert torch.equal(got["blk.1.exp_probs_b.bias"], state[L + "1.block_sparse_moe.gate.e_score_correction_bias"])
    # kv_b per head is [k_nope rows; v rows]: k_b holds the k rows transposed, v_b the v rows
    kv_b = state[L + "4.self_attn.kv_b_proj.weight"].view(2, 16 + 16, 16)
    assert torch.equal(got["blk.4.attn_k_b.weight"], kv_b[:, :16].transpose(1, 2))
    assert torch.equal(got["blk.4.attn_v_b.weight"], kv_b[:, 16:])
    for which, gguf_name in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
        stacked = torch.stack([state[f"{L}2.block_sparse_moe.experts.{e}.{which}.weight"] for e in range(8)])
        assert torch.equal(got[f"blk.2.ffn_{gguf_name}_exps.weight"], stacked)
    for gguf_name, k3_name in (("attn_res_score", "self_attention_res"), ("ffn_res_score", "mlp_res")):
        fused = state[f"{L}1.{k3_name}_norm.weight"].double() * state[f"{L}1.{k3_name}_proj.weight"].double()[0]
        assert torch.equal(got[f"blk.1.{gguf_name}.weight"], fused.float())
        assert fused.abs().max() > 0  # random queries: the term is exercised
    out = state["model.output_attn_res_norm.weight"].double() * state["model.output_attn_res_proj.weight"][0]
    assert torch.equal(got["output_res_score.weight"], out.float())


def test_bf16_rounds_the_matrices_only(exported):
    f32 = {n: as_torch(t) for n, t in tensors(exported["f32"]).items()}
    for name, t in tensors(exported["bf16"]).items():
        want = f32[name] if t.tensor_type.name == "F32" else f32[name].bfloat16().float()
        assert torch.equal(as_torch(t), want), name
    assert not torch.equal(f32["blk.0.attn_q.weight"], f32["blk.0.attn_q.weight"].bfloat16().float())


def test_mxfp4_blocks_are_k3s_packing_bit_for_bit(run, exported):
    state = load_pretrained(run).model.state_dict()
    got = tensors(exported["mxfp4"])
    for which, gguf_name in (("w1", "gate"), ("w2", "down")):
        t = got[f"blk.3.ffn_{gguf_name}_exps.weight"]
        raw = np.asarray(t.data).reshape(8, -1, 17 * (int(t.shape[0]) // 32))
        for e in (0, 5):
            w = state[f"model.layers.3.block_sparse_moe.experts.{e}.{which}.weight"]
            packed, scale = pack_mxfp4(w)
            blocks = torch.from_numpy(raw[e].copy()).view(w.shape[0], -1, 17)
            assert torch.equal(blocks[..., 0], scale)
            codes = torch.stack((packed & 15, packed >> 4), -1).view(w.shape[0], -1, 32)
            assert torch.equal(blocks[..., 1:] & 15, codes[..., :16])  # inputs 0..15 in the low nibbles
            assert torch.equal(blocks[..., 1:] >> 4, codes[..., 16:])
            assert torch.equal(as_torch(t)[e], unpack_mxfp4(packed, scale))  # ggml's reading of the blocks


def test_byte_tokenizer_has_an_empty_typed_merge_list(run, exported):
    f = fields(exported["f32"])
    reader = gguf.GGUFReader(exported["f32"])
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == PRE_TOKENIZER == "trillion"
    assert f["tokenizer.ggml.merges"] == []  # present (libllama requires it), typed, empty
    parts = reader.fields["tokenizer.ggml.merges"].parts  # key length, key, ARRAY, element type, count
    assert [int(p[0]) for p in parts[2:]] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, 0]
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    tok = K3Tokenizer.load(load_pretrained(run).tokenizer_path).tok
    n = tok.get_vocab_size()
    assert len(tokens) == len(types) == n == 256 + len(SPECIAL_TOKENS) == load_pretrained(run).config.vocab_size
    assert tokens == [tok.id_to_token(i) for i in range(n)]
    assert [types[tok.token_to_id(s)] for s in SPECIAL_TOKENS] == [3] * len(SPECIAL_TOKENS)  # CONTROL
    assert tokens[tok.token_to_id("Ġ")] == "Ġ" and types[tok.token_to_id("Ġ")] == 1
    assert types.count(1) == 256
    assert f["tokenizer.ggml.eos_token_id"] == tok.token_to_id("<|endoftext|>")
    assert f["tokenizer.ggml.eot_token_id"] == tok.token_to_id("<|end_of_msg|>")
    assert f["tokenizer.ggml.add_bos_token"] is False
    assert f["tokenizer.chat_template"] == chat_template()


def test_trained_tokenizer_merges_in_rank_order(tmp_path):
    tokenizer = trained_tokenizer()
    tokenizer.save(tmp_path / "tokenizer.json")
    vocab = gguf_vocab(tmp_path / "tokenizer.json", K3Config.from_preset("tiny"))
    merges = json.loads(tokenizer.tok.to_str())["model"]["merges"]
    assert len(merges) > 50 and vocab["tokenizer.ggml.merges"][0] == [" ".join(m) for m in merges]
    tokens, types = vocab["tokenizer.ggml.tokens"][0], vocab["tokenizer.ggml.token_type"][0]
    n = tokenizer.vocab_size
    assert len(tokens) == len(types) == 512 and n < 512
    assert set(types[n:]) == {5} and tokens[n] == f"<|k3_unused_{n}|>"  # embedding rows no token uses
    for left_right in vocab["tokenizer.ggml.merges"][0][:50]:
        assert left_right.replace(" ", "") in tokens  # each merge makes a token of the vocabulary


@pytest.mark.parametrize("text", TRICKY)
def test_pre_tokenizer_splits_as_llama_cpps_gpt2_split(text):
    pieces = llama_gpt2_split(text)
    assert "".join(pieces) == text
    k3_pieces = [p for p, _ in byte_tokenizer().tok.pre_tokenizer.pre_tokenize_str(text)]
    assert k3_pieces == [byte_level(p) for p in pieces]


def test_the_split_reimplementation_can_tell_splits_apart():
    assert llama_gpt2_split("a  b") == ["a", " ", " b"] and llama_gpt2_split("a  ") == ["a", "  "]
    assert llama_gpt2_split("it's 12ab") == ["it", "'s", " 12", "ab"]
    assert llama_gpt2_split(" \n x\t\ty") == [" \n", " x", "\t", "\t", "y"]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": 'Be brief & say "ok".'},
        {"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}], "name": "ann"},
        {"role": "assistant", "content": "ok", "reasoning_content": "short answer"},
        {"role": "developer", "content": "line1\nline2"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "sure", "reasoning_content": "  "},
    ],
]


OPTIONS = [{}, {"thinking": False}, {"thinking_effort": "low", "add_generation_prompt": False}]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("options", OPTIONS)
def test_chat_template_renders_as_k3_chat(messages, options):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(chat_template())
    context = {"add_generation_prompt": options.get("add_generation_prompt", True)}
    if "thinking" in options:
        context["enable_thinking"] = options["thinking"]  # llama.cpp's name for the switch
    if "thinking_effort" in options:
        context["thinking_effort"] = options["thinking_effort"]
    assert template.render(messages=messages, **context) == render_text(messages, **options)
    with pytest.raises(ValueError, match="no tools"):
        template.render(messages=messages, tools=[{"type": "function", "function": {"name": "f"}}])


def test_low_rank_gate_standard_residual_and_tied_embeddings():
    config = K3Config.from_preset("tiny", use_full_rank_gate=False, residual="standard", tie_word_embeddings=True)
    torch.manual_seed(0)
    state = K3Model(config).state_dict()
    written = list(gguf_tensors(state, config, "f32"))
    got = {name: (t, storage) for name, t, storage in written}
    assert len(got) == len(written)  # no name twice
    untied = {
        name for name, _, _ in gguf_tensors({k: v for k, v in state.items() if k != "lm_head.weight"}, config, "f32")
    }
    assert untied == set(got)
    a, b = state["model.layers.0.self_attn.g_a_proj.weight"], state["model.layers.0.self_attn.g_b_proj.weight"]
    assert torch.equal(got["blk.0.ssm_g.weight"][0], b.double() @ a.double())
    assert not any("res_score" in name for name in got)
    assert torch.equal(got["output.weight"][0], state["model.embed_tokens.weight"])
    assert sorted(got) == sorted(n for n in expected_shapes(config) if "res_score" not in n)


def test_errors_name_the_problem(run, exported, tmp_path, monkeypatch, capsys):
    base = ["export", "--ckpt", str(run), "--format", "gguf"]
    assert main([*base, "--out", str(exported["f32"])]) == 2
    assert "exists; choose a new --out or pass --force" in capsys.readouterr().err
    assert main([*base, "--out", str(exported["f32"]), "--force", "--outtype", "f32"]) == 0
    with pytest.raises(SystemExit):
        main([*base, "--out", str(tmp_path / "x.gguf"), "--outtype", "q4_0"])
    with pytest.raises(ModelFolderError, match="--outtype 'fp8'"):
        export_gguf(run, tmp_path / "x.gguf", outtype="fp8")
    assert main([*base, "--out", str(tmp_path / "x.gguf"), "--quantize", "mxfp4"]) == 2
    assert "--quantize shape a model folder" in capsys.readouterr().err
    assert main(["export", "--ckpt", str(run), "--out", str(tmp_path / "f"), "--outtype", "bf16"]) == 2
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".*"))

    torch.manual_seed(0)
    odd = K3Config.from_preset("tiny", routed_expert_hidden_size=48)
    with pytest.raises(ModelFolderError, match="routed_expert_hidden_size = 48 is not a multiple of 32"):
        write_gguf(K3Model(odd).state_dict(), odd, tmp_path / "odd.gguf", "mxfp4", tmp_path / "none.json")
    full_width = K3Config.from_preset("tiny", routed_expert_hidden_size=None, latent_moe_use_norm=False)
    with pytest.raises(ModelFolderError, match="a Kimi Linear model"):
        write_gguf(K3Model(full_width).state_dict(), full_width, tmp_path / "kl.gguf", "f32", tmp_path / "none.json")
    heads = K3Config.from_preset("tiny", kda_num_heads=4)
    with pytest.raises(ModelFolderError, match="kda_num_heads = 4 and num_attention_heads = 2"):
        write_gguf(K3Model(heads).state_dict(), heads, tmp_path / "h.gguf", "f32", tmp_path / "none.json")

    from tokenizers import Tokenizer, pre_tokenizers

    other = Tokenizer.from_str(byte_tokenizer().tok.to_str())
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    other.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ModelFolderError, match="not the byte-level BPE with the GPT-2 split"):
        gguf_vocab(tmp_path / "tokenizer.json", K3Config.from_preset("tiny"))

    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)
    assert main([*base, "--out", str(tmp_path / "y.gguf")]) == 2
    assert "pip install 'k3[gguf]'" in capsys.readouterr().err
