"""A bf16 model computes as the reference implementations do (HF, TensorRT-LLM, SGLang): the sums of AttnRes and of
the MoE combine in fp32, rounded to bf16 once; the tensors the release stores in F32 (KDA's short convolutions,
o_norm, A_log, dt_bias) kept in fp32. Each against float64 computed from the same bf16 numbers."""

import copy

import pytest
import torch

from k3 import K3Config
from k3.hub.export import release_config, release_tensors, weights_dtype, write_model_folder
from k3.hub.load import load_pretrained
from k3.model import K3Model
from k3.model.attn_res import attn_res
from k3.model.cache import K3Cache
from k3.model.kda import KimiDeltaAttention
from k3.model.model import KEEP_FP32
from k3.model.moe import combine
from k3.model.norm import RMSNorm
from k3.ops import cpu_library
from k3.ops.kda import cpu_kernel
from tiny_models import PoolRows, kda_step_both_ways

BF16 = torch.bfloat16


def exactly_rounded(x: torch.Tensor, exact: torch.Tensor) -> float:
    """The fraction of x's elements that are exact (float64) rounded to x's dtype once."""
    return (x == exact.to(x.dtype)).double().mean().item()


def test_attn_res_sums_in_fp32_and_rounds_once():
    torch.manual_seed(0)
    d = 384
    sources = [(torch.randn(3, 29, d) * (1 + s)).to(BF16) for s in range(9)]  # an embedding and 8 block sums
    proj, norm = torch.nn.Linear(d, 1, bias=False), RMSNorm(d, 1e-5)
    with torch.no_grad():
        proj.weight.normal_(0, 0.05)
    proj, norm = proj.to(BF16), norm.to(BF16)  # gain 1: g = w·γ is exact in bf16, as in float64
    exact = attn_res([v.double() for v in sources], copy.deepcopy(proj).double(), copy.deepcopy(norm).double())
    h = attn_res(sources, proj, norm)
    assert h.dtype == BF16
    # fp32 sums round to the exact result's bf16 value but where they land within fp32 noise of a tie; summed
    # in bf16 (before) 53% of the elements were another value
    assert exactly_rounded(h, exact) > 0.995


def test_moe_combine_sums_in_fp32_with_the_routing_weights():
    torch.manual_seed(0)
    T, K, E, L = 41, 6, 11, 64
    z = torch.randn(T, L).to(BF16)
    experts = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K).softmax(-1)  # fp32, as the router gives them
    scale = 2.0 ** torch.randint(-3, 4, (E, L)).to(BF16)  # powers of two: an expert's output is exact in bf16

    def experts_forward(z_AL, counts):  # expert e multiplies by scale[e]
        ids = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
        return z_AL * scale[ids].to(z_AL.dtype)

    counts = torch.bincount(experts.flatten(), minlength=E).tolist()
    u = combine(z, experts, weights, counts, experts_forward)
    exact = combine(z.double(), experts, weights.double(), counts, experts_forward)
    assert u.dtype == BF16
    assert exactly_rounded(u, exact) > 0.995  # summed in bf16 with bf16 weights (before): 79%


def test_cast_keeps_the_release_fp32_tensors():
    model = K3Model(K3Config.from_preset("tiny")).cast(BF16)
    kept = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert kept and all(n.endswith(KEEP_FP32) for n in kept)
    assert {n for n, p in model.named_parameters() if n.endswith(KEEP_FP32)} == kept
    assert all(p.dtype == BF16 for n, p in model.named_parameters() if n not in kept)
    assert all(p.dtype == torch.float64 for p in model.cast(torch.float64).parameters())  # wider: every tensor


def test_a_bf16_load_keeps_the_stored_fp32_values(tmp_path):
    """A folder with fp32 tensors (what k3 export writes for a fp32 run, and what the release stores for these)
    loads in bf16 with A_log, dt_bias, o_norm and the conv taps bit for bit, and runs: prefill in chunks and
    decoding token by token equal one uncached forward to bf16 rounding."""
    torch.manual_seed(0)
    model = K3Model(K3Config.from_preset("tiny"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(KEEP_FP32):
                p.add_(torch.randn_like(p) * 0.1)  # values bf16 cannot hold
    tensors = release_tensors(model.state_dict(), model.config)
    folder = write_model_folder(
        tensors, release_config(model.config, "model", None, None, weights_dtype(tensors)), tmp_path / "m"
    )
    loaded = load_pretrained(folder, dtype=BF16).model
    stored = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        if name.endswith(KEEP_FP32):
            assert p.dtype == torch.float32 and torch.equal(p, stored[name]), name
        else:
            assert p.dtype == BF16, name
    ids = torch.randint(0, model.config.vocab_size, (2, 13))
    with torch.no_grad():
        full = loaded(ids).logits
        assert full.dtype == BF16
        cache = K3Cache.empty(loaded.config)
        parts = [loaded(ids[:, :5], cache=cache).logits, loaded(ids[:, 5:9], cache=cache).logits]
        parts += [loaded(ids[:, t : t + 1], cache=cache).logits for t in range(9, 13)]
    stepped = torch.cat(parts, dim=1)
    assert ((stepped.float() - full.float()).norm() / full.float().norm()) < 2e-2


def test_fp32_taps_make_the_kda_layer_closer_to_float64():
    """The KDA layer with the release's fp32 tensors against the same layer entirely in bf16, both against float64
    from the bf16-rounded matrices: the kept tensors remove part of the error (measured 0.0067 against 0.0097)."""
    torch.manual_seed(0)
    config = K3Config.from_preset("tiny", kda_num_heads=4, kda_head_dim=32, hidden_size=128)
    layer = KimiDeltaAttention(config).double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith(KEEP_FP32):
                p.copy_(
                    {"A_log": torch.rand_like(p) * 2.5, "dt_bias": torch.randn_like(p)}.get(
                        name, p + 0.2 * torch.randn_like(p)
                    )
                )
            else:
                p.copy_(p.to(BF16).double())  # the matrices exact in bf16: only the kept tensors differ
    x = torch.randn(2, 150, config.hidden_size).to(BF16)
    with torch.no_grad():
        exact = layer(x.double())
        errors = {}
        for keep in (True, False):
            half = copy.deepcopy(layer)
            for name, p in half.named_parameters():
                p.data = p.data.float() if keep and name.endswith(KEEP_FP32) else p.data.to(BF16)
            out = half(x)
            assert out.dtype == BF16
            errors[keep] = ((out.double() - exact).norm() / exact.norm()).item()
    assert errors[True] < 0.8 * errors[False], errors


@pytest.mark.skipif(not cpu_library.load(), reason="k3's C++ library did not build here")
def test_decode_kernel_takes_fp32_taps_as_they_are(monkeypatch):
    """The C++ decoding step reads a bf16 model's fp32 taps without rounding them: equal to the PyTorch path
    (which convolves in fp32) to bf16 rounding, and closer to float64 than the same step with bf16 taps."""
    config = K3Config.from_preset("tiny", kda_num_heads=3, kda_head_dim=24)
    torch.manual_seed(0)
    layer = KimiDeltaAttention(config)
    layer.reset_gate_parameters()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.data = p.data.float() if name.endswith(KEEP_FP32) else p.data.to(BF16)
    B, P, H, K = 3, 7, 3, 24
    C, w = 3 * H * K, config.short_conv_kernel_size
    rows = torch.tensor([4, 0, 6])
    states, convs = torch.randn(P, H, K, K), torch.randn(P, C, w - 1).to(BF16)
    inputs = (torch.randn(B, 1, C).to(BF16), torch.randn(B, 1, H, K).to(BF16), torch.randn(B, 1, H).to(BF16))
    assert cpu_kernel.conv_step_usable(inputs[0], states, convs)
    (got, fast), (torch_path, slow) = kda_step_both_ways(layer, inputs, states, convs, rows, monkeypatch)
    with torch.no_grad():
        exact_rows = PoolRows(states.double(), convs.double(), rows)
        exact = copy.deepcopy(layer).double().mix(*(t.double() for t in inputs), exact_rows)
    assert got.dtype == BF16 and fast.states.dtype == torch.float32

    def error(x, exact):
        return ((x.double() - exact).abs().max() / exact.abs().max()).item()

    # the kernel keeps the convolution's output in fp32 where the PyTorch path rounds it to bf16 (as fla and HF
    # do): at least as accurate, and one bf16 rounding from float64
    for kernel, torch_path_value, exact_value in (
        (got, torch_path, exact),
        (fast.states, slow.states, exact_rows.states),
    ):
        assert error(kernel, exact_value) <= max(1.01 * error(torch_path_value, exact_value), 2**-8)
    assert error(got, exact) < 2**-7
