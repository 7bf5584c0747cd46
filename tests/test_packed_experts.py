"""Routed experts kept MXFP4-packed in memory (k3.quant.packed_experts): the same logits as the model whose
experts hold the dequantised weights, bitwise, in a full forward and through cached decoding; the bytes saved;
the state_dict names; and a clear refusal to train."""

import copy

import pytest
import torch

from k3 import K3Cache, generate
from k3.model.quantization import pack_experts, routed_expert_bytes, unpack_experts
from k3.quant import MXFP4Linear, PackedExpertTrainingError, pack_mxfp4, unpack_mxfp4
from tiny_models import tiny_model


def dequantised_and_packed(dtype: torch.dtype = torch.float32):
    """(reference, packed): the tiny model whose experts hold unpack(pack(w)) as ordinary weights, and a copy
    of it whose experts are packed."""
    reference = tiny_model(seed=3, router_bias_std=0.1).to(dtype)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if ".experts." in name:
                p.copy_(unpack_mxfp4(*pack_mxfp4(p), dtype=dtype))
    packed = copy.deepcopy(reference)
    assert pack_experts(packed) > 0
    return reference, packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_forward_is_bitwise_the_dequantised_model(dtype):
    reference, packed = dequantised_and_packed(dtype)
    ids = torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = reference(ids, labels=ids), packed(ids, labels=ids)
    assert got.logits.dtype == dtype
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.loss, expected.loss)


def test_packed_cached_decode_and_generate_are_bitwise_the_dequantised_model():
    reference, packed = dequantised_and_packed()
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        caches = [K3Cache.empty(m.config) for m in (reference, packed)]
        logits = [m(ids, cache=c).logits for m, c in zip((reference, packed), caches, strict=True)]
        assert torch.equal(logits[1], logits[0])
        for _ in range(6):  # token by token, both fed the reference's greedy choice
            token = logits[0][:, -1:].argmax(-1)
            logits = [m(token, cache=c).logits for m, c in zip((reference, packed), caches, strict=True)]
            assert torch.equal(logits[1], logits[0])
    assert torch.equal(generate(packed, ids, 8, temperature=0), generate(reference, ids, 8, temperature=0))


def test_resident_expert_bytes_drop_7_5x():
    """Per fp32 weight (out, in): 4·out·in bytes → out·in/2 packed + out·in/32 scales, 128/17 ≈ 7.53× less."""
    model = tiny_model().float()
    config = model.config
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    weights_per_layer = 3 * config.num_experts * config.routed_expert_hidden_size * config.moe_intermediate_size
    before = routed_expert_bytes(model)
    assert before == 4 * moe_layers * weights_per_layer
    saved = pack_experts(model)
    after = routed_expert_bytes(model)
    assert after == moe_layers * weights_per_layer * 17 // 32 and saved == before - after
    assert before / after == pytest.approx(128 / 17) and before / after >= 6
    assert pack_experts(model) == 0  # already packed: nothing more to do


def test_state_dict_names_are_the_release_names_and_load_back():
    reference, packed = dequantised_and_packed()
    state = packed.state_dict()
    expert_keys = sorted(k for k in state if ".experts." in k)
    assert expert_keys, "no routed experts found"
    assert all(k.rsplit(".", 1)[-1] in ("weight_packed", "weight_scale") for k in expert_keys)
    key = "model.layers.1.block_sparse_moe.experts.0.w1"
    assert state[f"{key}.weight_packed"].dtype == torch.uint8 and state[f"{key}.weight_scale"].dtype == torch.uint8
    L, I = packed.config.routed_expert_hidden_size, packed.config.moe_intermediate_size
    assert state[f"{key}.weight_packed"].shape == (I, L // 2) and state[f"{key}.weight_scale"].shape == (I, L // 32)
    assert not any(k.endswith(".weight") and ".experts." in k for k in state)
    assert set(state) - set(expert_keys) == set(reference.state_dict()) - {
        k for k in reference.state_dict() if ".experts." in k
    }
    fresh = copy.deepcopy(packed)
    for m in fresh.modules():
        if isinstance(m, MXFP4Linear):
            m.weight_packed.zero_()
    fresh.load_state_dict(state)
    ids = torch.randint(0, 512, (1, 11))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, reference(ids).logits)


def test_packed_experts_refuse_to_train_and_unpack_makes_them_trainable():
    reference, packed = dequantised_and_packed()
    n_params = sum(p.numel() for p in packed.parameters())
    assert n_params == sum(p.numel() for n, p in reference.named_parameters() if ".experts." not in n)
    ids = torch.randint(0, 512, (1, 12))
    packed.train()
    with pytest.raises(PackedExpertTrainingError, match=r"unpack_experts\(model\)"):
        packed(ids, labels=ids)
    with torch.no_grad():
        packed(ids)  # inference stays allowed in train mode without gradients
    unpack_experts(packed)
    assert sum(p.numel() for p in packed.parameters()) == sum(p.numel() for p in reference.parameters())
    packed.eval()
    with torch.no_grad():
        assert torch.equal(packed(ids).logits, reference(ids).logits)
    packed.train()
    packed(ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in packed.named_parameters() if ".experts." in n]
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in grads) > 0  # the routed ones got gradients


def test_follows_model_dtype_and_rejects_unpackable_experts():
    _, packed = dequantised_and_packed(torch.float32)
    packed.double()
    expert = packed.model.layers[1].block_sparse_moe.experts[0]
    assert expert.w2.weight.dtype == torch.float64 and expert.w2.weight_packed.dtype == torch.uint8
    with torch.no_grad():
        assert packed(torch.randint(0, 512, (1, 5))).logits.dtype == torch.float64
    odd = tiny_model(routed_expert_hidden_size=48).float()
    before = copy.deepcopy(odd.state_dict())
    with pytest.raises(ValueError, match=r"experts\.0\.w1: in_features 48 is not a multiple"):
        pack_experts(odd)
    assert odd.state_dict().keys() == before.keys()  # nothing was packed
