"""The tiny K3 model the model, runner, prefix-cache and engine tests share, and a pool-rows KDA cache."""

import torch

from k3 import K3Config, K3Model


def tiny_model(seed: int = 0, router_bias_std: float = 0.0, **overrides) -> K3Model:
    """float64, eval mode, with the zero-initialised AttnRes queries (and, if asked, the router bias)
    made random so that the terms they control are exercised by every comparison."""
    torch.manual_seed(seed)
    model = K3Model(K3Config.from_preset("tiny", **overrides)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.normal_(std=0.5)
        if router_bias_std:
            for layer in model.model.layers:
                if hasattr(layer, "block_sparse_moe"):
                    layer.block_sparse_moe.gate.e_score_correction_bias.normal_(std=router_bias_std)
    return model.eval()


def loss_and_grads(model: K3Model, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss of `model` on a fixed random batch (2 × 19 tokens) and every parameter gradient by
    name: what the tests of a hand-written backward compare with the composed formula swapped back in."""
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(seed))
    loss = model.train()(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


class PoolRows:
    """A KDA layer's decoding cache over rows of a pool (the protocol k3.serve.kda_state.PagedKDAState keeps):
    states (P, H, K, V) and conv tails (P, C, w − 1), of which the rows `rows` are the batch's."""

    def __init__(self, states: torch.Tensor, convs: torch.Tensor, rows: torch.Tensor):
        self.states, self.convs, self.rows = states, convs, rows

    def decode_rows(self):
        return self.states, self.convs, self.rows

    @property
    def conv(self):
        return self.convs[self.rows]

    @conv.setter
    def conv(self, value):
        self.convs[self.rows] = value.to(self.convs.dtype)

    def update_state(self, step):
        return step(self.states, self.rows)


@torch.no_grad()
def kda_step_both_ways(layer, inputs, states, convs, rows, monkeypatch):
    """A KDA layer's one-token mixing of inputs = (qkv, g_raw, beta_raw) over pool rows, on the C++ decoding kernel
    and then (the kernel switched off through monkeypatch) on the PyTorch path, each from copies of the states
    and tails: ((out, PoolRows) of the kernel, (out, PoolRows) of the PyTorch path)."""
    from k3.ops.kda import cpu_kernel

    fast = PoolRows(states.clone(), convs.clone(), rows)
    got = layer.mix(*inputs, fast)
    slow = PoolRows(states.clone(), convs.clone(), rows)
    monkeypatch.setattr(cpu_kernel, "conv_step_usable", lambda *a: False)
    monkeypatch.setattr(cpu_kernel, "step_usable", lambda *a: False)
    return (got, fast), (layer.mix(*inputs, slow), slow)
