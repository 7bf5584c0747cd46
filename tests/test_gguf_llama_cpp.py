"""The exported GGUF files run in llama.cpp itself: libllama built from the llama-cpp-python source package
(tests/llama_cpp_build.py; minutes the first time, then cached), driven by tests/llama_cpp_probe.cpp on the
CPU with flash attention off. Compared with k3 in float64 on the same token sequence: logits at every
position (prompt and generated), llama.cpp's greedy continuation against k3's, and the tokenizer
(token ids of tricky text, and text back from ids).

Relative error here is max |logits_llama − logits_k3| / max |logits_k3| over all positions."""

import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gguf_models import TRICKY
from k3 import K3Config, K3Model
from k3.cli import main
from k3.formats.tokenizer import K3Tokenizer, byte_tokenizer
from k3.hub import load_pretrained
from k3.hub.gguf import write_gguf
from llama_cpp_build import LlamaCppUnavailable, build_libllama, build_probe
from tiny_runs import tiny_train_args

pytestmark = pytest.mark.slow
pytest.importorskip("gguf")

GENERATED = 32
# text whose decoding llama.cpp's `gpt-2` pre-tokenizer type would change (space clean-up); `trillion` keeps it
SPACES = "Hello . world 's here ? and ! that , it ' s"


@pytest.fixture(scope="module")
def probe() -> Path:
    try:
        lib, src, seconds = build_libllama()
    except LlamaCppUnavailable as e:
        pytest.skip(str(e))
    print(f"\nlibllama: {lib} ({f'built in {seconds:.0f} s' if seconds else 'cached build'})")
    return build_probe(lib, src)


@dataclass
class Run:
    rows: torch.Tensor  # (n + m, vocab) logits after each position
    generated: list[int]


def ask(probe: Path, gguf_path: Path, requests: list[str]) -> list[str]:
    done = subprocess.run(
        [str(probe), str(gguf_path)], input="\n".join(requests) + "\n", capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def llama_run(probe: Path, gguf_path: Path, prompt: list[int]) -> Run:
    lines = ask(probe, gguf_path, [f"L {len(prompt)} {' '.join(map(str, prompt))} {GENERATED}"])
    rows = [[float(x) for x in line.split()[1:]] for line in lines if line.startswith("R")]
    generated = [int(x) for x in lines[-1].split()[1:]]
    assert lines[-1].startswith("G") and len(rows) == len(prompt) + GENERATED
    return Run(torch.tensor(rows, dtype=torch.float64), generated)


@torch.no_grad()
def k3_logits(model: K3Model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].double()


@torch.no_grad()
def k3_greedy(model: K3Model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(GENERATED):
        ids.append(int(k3_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def leading_matches(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare(probe, gguf_path, model, prompt, label) -> tuple[float, int]:
    """(relative logit error over the prompt and llama.cpp's continuation, greedy tokens agreeing)."""
    got = llama_run(probe, gguf_path, prompt)
    ref = k3_logits(model, prompt + got.generated)
    rel = float((got.rows - ref).abs().max() / ref.abs().max())
    agree = leading_matches(got.generated, k3_greedy(model, prompt))
    print(f"{label}: logits rel err {rel:.2e}, greedy {agree}/{GENERATED}")
    return rel, agree


def random_model(**overrides) -> K3Model:
    torch.manual_seed(1)
    model = K3Model(K3Config.from_preset("tiny", **overrides)).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_res_proj.weight",)):
                p.normal_(std=0.5)
        for layer in model.model.layers:
            if hasattr(layer, "block_sparse_moe"):
                layer.block_sparse_moe.gate.e_score_correction_bias.normal_(std=0.1)
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """k3 train on the tiny preset for 40 steps: a trained tokenizer (merges) and weights that have moved."""
    tmp = tmp_path_factory.mktemp("trained")
    args = tiny_train_args(tmp)
    args[args.index("--steps") + 1] = "40"
    args[args.index("--eval-every") + 1] = "40"
    assert main([*args, "--out", str(tmp / "run")]) == 0
    return tmp / "run"


def export(run: Path, out: Path, outtype: str) -> Path:
    assert main(["export", "--ckpt", str(run), "--out", str(out), "--format", "gguf", "--outtype", outtype]) == 0
    return out


def test_trained_model_f32_bf16_mxfp4(probe, trained, tmp_path):
    pretrained = load_pretrained(trained)
    model = pretrained.model.double().eval()
    tokenizer = K3Tokenizer.load(pretrained.tokenizer_path)
    prompt = tokenizer.encode("def f_3_4(x):\n    return x *")
    rel, agree = compare(probe, export(trained, tmp_path / "f32.gguf", "f32"), model, prompt, "trained f32")
    assert rel < 1e-4 and agree == GENERATED
    rel, agree = compare(probe, export(trained, tmp_path / "bf16.gguf", "bf16"), model, prompt, "trained bf16")
    assert rel < 5e-2
    mxfp4 = export(trained, tmp_path / "mxfp4.gguf", "mxfp4")
    rel, agree = compare(probe, mxfp4, model, prompt, "trained mxfp4 vs k3 dense")
    qat = K3Model(K3Config.from_preset("tiny", vocab_size=model.config.vocab_size, expert_quantization="mxfp4"))
    qat.load_state_dict(model.state_dict())
    compare(probe, mxfp4, qat.double().eval(), prompt, "trained mxfp4 vs k3 with MXFP4 experts and MXFP8 inputs")
    assert rel < 2e-1


def test_random_models_and_variants(probe, tmp_path, monkeypatch):
    tokenizer = tmp_path / "tokenizer.json"
    byte_tokenizer().save(tokenizer)
    prompt = K3Tokenizer.load(tokenizer).encode("Hello, K3! 12 + 30 = 42")
    variants = {
        "random": {},  # vocab 512 > the tokenizer's 265: unused rows
        "unbounded gate, low-rank output gate, no q LoRA, 2 shared experts": dict(
            gate_lower_bound=None, use_full_rank_gate=False, q_lora_rank=None, num_shared_experts=2
        ),
        "standard residual, tied embeddings, no latent norm": dict(
            residual="standard", tie_word_embeddings=True, latent_moe_use_norm=False
        ),
    }
    import k3.ops.kda.inputs as inputs

    l2norm = inputs.l2norm
    for label, overrides in variants.items():
        model = random_model(**overrides)
        path = write_gguf(model.state_dict(), model.config, tmp_path / "m.gguf", "f32", tokenizer, force=True)
        rel, agree = compare(probe, path, model, prompt, f"{label} f32")
        assert rel < 3e-3 and agree == GENERATED
        # llama.cpp's KDA q/k L2 norm uses rms_norm_eps (1e-5) where k3, fla and the release use 1e-6 (no GGUF
        # key sets it apart); random weights leave q and k small enough for that to show. With k3 given the
        # same eps, what is left is float32 against float64 (most of it in llama.cpp's chunked KDA prefill)
        monkeypatch.setattr(inputs, "l2norm", functools.partial(l2norm, eps=model.config.rms_norm_eps))
        aligned, agree = compare(probe, path, model, prompt, f"{label} f32, k3 with L2-norm eps 1e-5")
        monkeypatch.setattr(inputs, "l2norm", l2norm)
        assert aligned < 2e-4 and aligned < rel / 3 and agree == GENERATED
    model = random_model()
    for outtype in ("bf16", "mxfp4"):
        path = write_gguf(model.state_dict(), model.config, tmp_path / f"{outtype}.gguf", outtype, tokenizer)
        compare(probe, path, model, prompt, f"random {outtype}")


def test_tokenizer_agrees(probe, trained, tmp_path):
    path = export(trained, tmp_path / "f32.gguf", "f32")
    tokenizer = K3Tokenizer.load(load_pretrained(trained).tokenizer_path)
    texts = [*TRICKY, SPACES]
    lines = ask(probe, path, [f"T {t.encode().hex()}" for t in texts])
    for text, line in zip(texts, lines, strict=True):
        assert [int(x) for x in line.split()[1:]] == tokenizer.encode(text), text
    ids = [tokenizer.encode(t) for t in texts]
    lines = ask(probe, path, [f"D {' '.join(map(str, i))}" for i in ids])
    for text, i, line in zip(texts, ids, lines, strict=True):
        decoded = bytes.fromhex(line[2:]).decode()
        assert decoded == tokenizer.decode(i) == text, text
    assert any(len(i) < len(t.encode()) for i, t in zip(ids, texts, strict=True))  # merges were used
