"""Kimi Linear, the released architecture K3 extends, read by k3 from the folder transformers itself writes.

transformers' `KimiLinearForCausalLM` (5.23+) is the oracle: a tiny one is built, every parameter and the router
biases re-randomised so each path carries signal (norm gains, gate biases, A_log, dt_bias, expert biases), saved
with `save_pretrained`, and loaded by k3 from that folder. k3 must give its logits in fp32 (≤ 1e-4 of the logits'
scale), the same greedy tokens, and the same logits after a chunked prefill and cached decoding.
"""

import json
import math

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from k3 import LLM, K3Cache, K3Config, K3Model, SamplingParams
from k3.cli import main
from k3.formats.tokenizer import byte_tokenizer
from k3.hub import ModelFolderError, load_pretrained
from k3.hub.export import export_model

VOCAB = 320  # above the byte tokenizer's 265 tokens, which the CLI and LLM need (the folder gets one below)
TOLERANCE = 1e-4  # max |k3 − transformers| over max |transformers|, fp32


def tiny_kimi_linear_config() -> KimiLinearConfig:
    """Four layers (KDA, KDA, MLA, KDA), a dense first FFN then MoE with a shared expert, query LoRA on.
    rms_norm_eps 1e-3 differs from the 1e-6 Kimi Linear's code fixes for MLA's latent norms, so using the wrong
    one shows in the logits (test_the_latent_norm_eps_is_kimi_linears)."""
    return KimiLinearConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=12,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_shared_experts=1,
        num_local_experts=6,
        num_experts_per_tok=2,
        routed_scaling_factor=2.446,
        rms_norm_eps=1e-3,
        first_k_dense_replace=1,
        linear_attn_config={
            "kda_layers": [1, 2, 4],
            "full_attn_layers": [3],
            "head_dim": 8,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


@torch.no_grad()
def rerandomise(model: KimiLinearForCausalLM, seed: int = 0) -> None:
    """Every parameter and buffer drawn afresh, at scales where each path moves the logits: matrices with
    unit-variance outputs, norm gains around 1, KDA decay rates exp(A_log) in [1, 4.5] and dt_bias ~ N(0, 1),
    router biases large enough to change which experts win."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=g) * 1.5)
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=g))
        elif p.dim() == 1:  # RMSNorm gains (the gated output norm's too)
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        elif "conv1d" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:  # (out, in) matrices, and the experts' stacked (E, out, in) ones
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(transformers' model, the folder it saved, with a k3 byte tokenizer added for the CLI and LLM)."""
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(tiny_kimi_linear_config()).float().eval()
    rerandomise(hf)
    folder = tmp_path_factory.mktemp("kimi_linear")
    hf.save_pretrained(folder)
    byte_tokenizer().save(folder / "tokenizer.json")
    return hf, folder


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def tokens(seed: int, shape=(2, 23)) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_the_folder_reads_as_kimi_linear(oracle):
    _, folder = oracle
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "kimi_linear" and "gate_lower_bound" not in raw["linear_attn_config"]
    config = K3Config.from_hf(folder)
    assert config.family == "kimi_linear"
    assert (config.gate_lower_bound, config.use_full_rank_gate, config.mla_use_output_gate) == (None, False, False)
    assert (config.routed_expert_hidden_size, config.latent_moe_use_norm, config.hidden_act) == (None, False, "silu")
    assert (config.residual, config.attn_res_block_size, config.mla_latent_norm_eps) == ("standard", None, 1e-6)
    assert config.layer_types == ("kda", "kda", "mla", "kda") and config.ffn_types == ("dense", "moe", "moe", "moe")
    assert (config.num_experts, config.num_experts_per_token, config.routed_scaling_factor) == (6, 2, 2.446)
    assert config.to_hf() == raw  # written back as it was read


def test_logits_match_transformers(oracle):
    hf, folder = oracle
    model = load_pretrained(folder).model
    x = tokens(1)
    with torch.no_grad():
        want = hf(x, use_cache=False).logits
        got = model(x).logits
    assert want.abs().max() > 1  # the logits carry signal
    assert relative_error(got, want) <= TOLERANCE
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_latent_norm_eps_is_kimi_linears(oracle):
    """The control that shows the comparison can fail: with K3's rule (the latent norms at rms_norm_eps) the
    logits leave the tolerance."""
    hf, folder = oracle
    pretrained = load_pretrained(folder)
    config = K3Config.from_hf(folder)
    config.mla_latent_norm_eps = None
    k3_rule = K3Model(config).eval()
    k3_rule.load_state_dict(pretrained.model.state_dict())
    x = tokens(2)
    with torch.no_grad():
        assert relative_error(k3_rule(x).logits, hf(x, use_cache=False).logits) > 5 * TOLERANCE


def test_chunked_prefill_and_cached_decode_match_transformers(oracle):
    """Prefill in pieces of 9 and 7 tokens, then one token at a time: every step's logits against
    transformers' uncached forward of the whole sequence, and against k3's own."""
    hf, folder = oracle
    model = load_pretrained(folder).model
    x = tokens(3, (2, 21))
    cache, outs = K3Cache.empty(model.config), []
    with torch.no_grad():
        for piece in (x[:, :9], x[:, 9:16], *x[:, 16:].split(1, dim=1)):
            outs.append(model(piece, cache=cache).logits)
        cached = torch.cat(outs, dim=1)
        want = hf(x, use_cache=False).logits
        assert relative_error(cached, model(x).logits) <= 1e-5
    assert relative_error(cached, want) <= TOLERANCE


def test_greedy_tokens_match_transformers(oracle):
    """k3's engine (LLM(model=folder), paged caches, batched) against transformers' own cached generate."""
    hf, folder = oracle
    prompts = tokens(4, (2, 11))
    with torch.no_grad():
        want = hf.generate(prompts, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with LLM(model=folder, compile=False) as llm:
        done = llm.generate(prompts.tolist(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [c.token_ids for c in done] == want[:, 11:].tolist()


def test_export_writes_kimi_linears_layout_which_transformers_reads(oracle, tmp_path):
    hf, folder = oracle
    out = export_model(folder, tmp_path / "export")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["KimiLinearForCausalLM"] and raw["model_type"] == "kimi_linear"
    back = KimiLinearForCausalLM.from_pretrained(out).float().eval()
    x = tokens(5)
    with torch.no_grad():
        assert torch.equal(back(x, use_cache=False).logits, hf(x, use_cache=False).logits)


def test_generate_and_init_from_take_the_folder(oracle, tmp_path, capsys):
    _, folder = oracle
    assert main(["generate", "--model", str(folder), "--max-tokens", "4", "--temperature", "0", "hello"]) == 0
    assert capsys.readouterr().out.startswith("hello")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"m{i}.py").write_text(f"def f_{i}(x):\n    return x + {i}\n" * 3)
    args = ["train", "--out", str(tmp_path / "ft"), "--init-from", str(folder), "--data", str(corpus)]
    args += ["--batch-size", "2", "--seq-len", "16", "--steps", "2", "--eval-every", "2", "--eval-batches", "1"]
    assert main([*args, "--warmup", "1", "--no-progress"]) == 0
    losses = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in losses if "loss" in r)
    trained = load_pretrained(tmp_path / "ft")
    assert trained.config.family == "kimi_linear" and trained.config.mla_latent_norm_eps == 1e-6


def test_a_folder_without_a_tokenizer_loads_for_token_ids_only(oracle, tmp_path):
    """transformers writes no tokenizer.json (Kimi Linear's own is tiktoken's): the weights load, text does not."""
    _, folder = oracle
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((folder / f).read_bytes())
    assert load_pretrained(bare).tokenizer_path is None
    with pytest.raises(ModelFolderError, match=r"no tokenizer\.json in the model folder"):
        LLM(model=bare)
