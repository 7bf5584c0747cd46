"""The whole model: cache consistency, loss, gradients, generation."""

import pytest
import torch
import torch.nn.functional as F

from k3 import K3Cache, generate
from tiny_models import tiny_model as shared_tiny_model


def tiny_model(seed: int = 0, **overrides):
    return shared_tiny_model(seed, router_bias_std=0.05, **overrides)


@pytest.mark.parametrize("impl", ["naive", "absorbed", "auto"])
@pytest.mark.parametrize("residual", ["attnres", "standard"])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_prefill_then_decode_equals_uncached(impl, residual, seed):
    """Prefill in chunks of random sizes, then decode token by token: the same logits as one
    uncached forward (KDA state, conv tails and MLA latents all carried by the cache)."""
    model = tiny_model(seed, mla_impl=impl, residual=residual)
    gen = torch.Generator().manual_seed(seed)
    T = 41
    ids = torch.randint(0, 512, (2, T), generator=gen)
    with torch.no_grad():
        ref = model(ids).logits
        cache, outs, pos = K3Cache.empty(model.config), [], 0
        while pos < 30:
            n = min(30 - pos, int(torch.randint(1, 12, (1,), generator=gen)))
            outs.append(model(ids[:, pos : pos + n], cache=cache).logits)
            pos += n
        for t in range(30, T):
            outs.append(model(ids[:, t : t + 1], cache=cache).logits)
    got = torch.cat(outs, dim=1)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() < 1e-10
    assert cache.seq_len == T


def test_cache_sizes():
    model = tiny_model()
    cache = K3Cache.empty(model.config)
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 20)), cache=cache)
    c = model.config
    n_mla, n_kda = c.layer_types.count("mla"), c.layer_types.count("kda")
    per_token_mla = n_mla * (c.kv_lora_rank + c.qk_rope_head_dim) * 8  # float64 model
    kda_state = n_kda * c.kda_num_heads * c.kda_head_dim**2 * 8
    kda_conv = n_kda * 3 * (c.short_conv_kernel_size - 1) * c.kda_num_heads * c.kda_head_dim * 8
    assert cache.nbytes() == {"mla": 20 * per_token_mla, "kda": kda_state + kda_conv}


def test_loss_is_next_token_cross_entropy():
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 17))
    labels = ids.clone()
    labels[0, 5] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 512)
    target = labels[:, 1:].reshape(-1)
    keep = target != -100
    assert torch.allclose(out.loss, F.cross_entropy(logits[keep], target[keep]))


def test_every_parameter_gets_a_gradient():
    model = tiny_model().train()
    ids = torch.randint(0, 512, (4, 33))
    out = model(ids, labels=ids)
    out.loss.backward()
    moe_layers = [i for i, f in enumerate(model.config.ffn_types) if f == "moe"]
    used = {(i, e) for i, r in zip(moe_layers, out.routing, strict=True) for e in r.experts_TK.flatten().tolist()}
    for name, p in model.named_parameters():
        if ".experts." in name:
            layer, expert = int(name.split(".")[2]), int(name.split(".experts.")[1].split(".")[0])
            if (layer, expert) not in used:
                continue  # an expert no token was routed to gets no gradient, correctly
        if name.startswith("model.layers.0.self_attention_res_"):
            continue  # the first sublayer mixes one source (the embedding): its query has nothing to weigh
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert len(out.routing) == model.config.ffn_types.count("moe")


def test_generate_greedy_matches_uncached_argmax():
    model = tiny_model()
    prompt = torch.randint(0, 512, (2, 6))
    out = generate(model, prompt, max_new_tokens=8, temperature=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)


def test_generate_sampling_is_seeded_and_top_p_narrows():
    model = tiny_model()
    prompt = torch.randint(0, 512, (1, 4))
    a = generate(model, prompt, 10, temperature=1.0, seed=3)
    b = generate(model, prompt, 10, temperature=1.0, seed=3)
    c = generate(model, prompt, 10, temperature=1.0, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # a top_p this small keeps only the most likely token: the same as greedy
    assert torch.equal(generate(model, prompt, 10, top_p=1e-9, seed=5), generate(model, prompt, 10, temperature=0))


def test_generate_stops_at_eos_and_rejects_bad_input():
    model = tiny_model()
    prompt = torch.randint(0, 512, (1, 4))
    first = generate(model, prompt, 1, temperature=0)[0, -1].item()
    out = generate(model, prompt, 20, temperature=0, eos_token_id=first)
    assert out.shape[1] == 5 and out[0, -1] == first
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        generate(model, torch.zeros(3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 2, temperature=-1)
