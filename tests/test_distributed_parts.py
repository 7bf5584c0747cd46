"""The distributed parts against the single process, on 2 gloo processes started once for the module:

- expert parallelism equals the single-process LatentMoE in float64: outputs, the gradient of the input and of
  every parameter (each rank's experts, and the replicated parts summed over ranks);
- Quantile Balancing sets bitwise the same biases on every rank, from all-reduced histograms;
- Muon on FSDP2-sharded matrices orthogonalises the full matrix (each head block of a Q/K/V projection):
  the single-process update within float64 tolerance.
"""

import pytest
import torch
from torch import nn

from dist_helpers import spawn
from k3 import K3Config
from k3.model.moe import LatentMoE
from k3.train.balance import QuantileBalancer
from k3.train.expert_parallel import shard_experts
from k3.train.muon import MuonAdamW

# (tokens per rank, expert quantisation): at 5 some experts receive nothing and the ranks send unequal counts;
# "mxfp4" is quantisation-aware training inside experts_forward (MXFP4 weights, MXFP8 inputs), which EP wraps
EP_CASES = ((24, None), (5, None), (24, "mxfp4"))


def _moe(quantization: str | None = None) -> LatentMoE:
    torch.manual_seed(0)
    config = K3Config.from_preset("tiny", expert_quantization=quantization)
    moe = LatentMoE(config).double()
    with torch.no_grad():  # K3Model initialises its modules; alone, a LatentMoE's weights are empty
        for p in moe.parameters():
            p.normal_(std=0.2) if p.ndim == 2 else p.fill_(1.0)
        # a skewed bias so some experts get many rows and one may get none
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, config.num_experts))
    return moe


def _inputs(world: int, tokens: int, dim: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world, tokens, dim, generator=g, dtype=torch.float64)
    w = torch.randn(world, tokens, dim, generator=g, dtype=torch.float64)  # loss = Σ y·w: a gradient per element
    return x, w


def _ep_worker(rank: int, world: int, out_dir) -> None:
    for tokens, quantization in EP_CASES:
        moe = _moe(quantization)
        mine = shard_experts(moe, rank, world)
        x, w = _inputs(world, tokens, moe.routed_expert_down_proj.in_features)
        x = x[rank].clone().requires_grad_()
        y, _ = moe(x)
        (y * w[rank]).sum().backward()
        grads = {n: p.grad for n, p in moe.named_parameters() if p.grad is not None}
        result = {"y": y.detach(), "dx": x.grad, "grads": grads, "mine": list(mine)}
        torch.save(result, out_dir / f"t{tokens}_{quantization}_rank{rank}.pt")


def _check(out_dir, tokens: int, quantization: str | None, world: int) -> None:
    moe = _moe(quantization)
    x, w = _inputs(world, tokens, moe.routed_expert_down_proj.in_features)
    x = x.reshape(world * tokens, -1).requires_grad_()
    y, routing = moe(x)
    (y * w.reshape(world * tokens, -1)).sum().backward()
    assert (routing.loads_E > 0).sum() >= 2, "the test needs tokens for experts on both ranks"
    ref = dict(moe.named_parameters())
    summed: dict[str, torch.Tensor] = {}
    for rank in range(world):
        got = torch.load(out_dir / f"t{tokens}_{quantization}_rank{rank}.pt")
        rows = slice(rank * tokens, (rank + 1) * tokens)
        torch.testing.assert_close(got["y"], y.detach()[rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["dx"], x.grad[rows], rtol=1e-12, atol=1e-12)
        for name, grad in got["grads"].items():
            if ".experts." in name:  # this rank's expert: its gradient is the whole batch's, from both ranks
                assert int(name.split(".experts.")[1].split(".")[0]) in got["mine"]
                torch.testing.assert_close(grad, ref[name].grad, rtol=1e-12, atol=1e-12)
            else:  # replicated: the ranks' gradients sum to the single process's (data parallel)
                summed[name] = summed.get(name, 0) + grad
        experts_with_grad = {n for n in got["grads"] if ".experts." in n}
        expected = {
            n
            for n, p in ref.items()
            if ".experts." in n and p.grad is not None and int(n.split(".experts.")[1].split(".")[0]) in got["mine"]
        }
        assert experts_with_grad == expected
    for name, grad in summed.items():
        torch.testing.assert_close(grad, ref[name].grad, rtol=1e-10, atol=1e-12)
    assert set(summed) == {n for n, p in ref.items() if ".experts." not in n and p.grad is not None}


TOKENS = 40


def _router_inputs(world: int):
    torch.manual_seed(0)
    moe = LatentMoE(K3Config.from_preset("tiny"))
    with torch.no_grad():
        moe.gate.weight.normal_(std=0.5)
        moe.gate.weight[:2] += 0.05  # skewed: experts 0 and 1 are everyone's favourites
    x = torch.randn(world * TOKENS, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(2)) + 0.5
    return moe.gate, x


def _balance(gate, x_TD, steps: int = 3) -> torch.Tensor:
    balancer = QuantileBalancer([gate], num_bins=1000)
    for _ in range(steps):
        with torch.no_grad():
            balancer.observe([gate(x_TD)])
        balancer.update()
    return gate.e_score_correction_bias.clone()


def _matrices():
    g = torch.Generator().manual_seed(3)
    weights = {
        "q": torch.randn(10, 6, generator=g, dtype=torch.float64),  # 2 heads of 5 rows
        "o": torch.randn(5, 4, generator=g, dtype=torch.float64),  # rows 3 + 2 over 2 ranks
        "v": torch.randn(7, generator=g, dtype=torch.float64),
    }
    grads = [{k: torch.randn(w.shape, generator=g, dtype=torch.float64) for k, w in weights.items()} for _ in range(3)]
    return weights, grads


class _Params(nn.Module):
    def __init__(self, weights):
        super().__init__()
        for k, w in weights.items():
            self.register_parameter(k, nn.Parameter(w.clone()))


def _optimizer(m: _Params) -> MuonAdamW:
    groups = [
        dict(algo="muon", params=[m.q], heads=2),
        dict(algo="muon", params=[m.o]),
        dict(algo="adamw", params=[m.v]),
    ]
    return MuonAdamW(groups, lr=0.05, weight_decay=0.1)


def _steps(m: _Params, opt: MuonAdamW, grads, place=lambda p, g: g) -> None:
    for step_grads in grads:
        for k, p in m.named_parameters():
            p.grad = place(p, step_grads[k])
        opt.step()


def _worker(rank: int, world: int, out_dir) -> None:
    _ep_worker(rank, world, out_dir)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    gate, x = _router_inputs(world)
    bias = _balance(gate, x[rank * TOKENS : (rank + 1) * TOKENS])
    weights, grads = _matrices()
    m = _Params(weights)
    fully_shard(m)
    assert m.o.to_local().shape[0] == (3 if rank == 0 else 2)
    _steps(m, _optimizer(m), grads, lambda p, g: distribute_tensor(g, p.device_mesh, p.placements))
    full = {k: p.full_tensor() for k, p in m.named_parameters()}
    torch.save({"bias": bias, "params": full}, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    spawn(_worker, out, out, world=2)
    return out


def test_expert_parallel_equals_single_process_float64_with_and_without_qat(ranks_out):
    for tokens, quantization in EP_CASES:
        _check(ranks_out, tokens, quantization, world=2)


def test_balancer_and_sharded_muon_equal_single_process(ranks_out):
    got = [torch.load(ranks_out / f"rank{r}.pt") for r in range(2)]
    assert torch.equal(got[0]["bias"], got[1]["bias"]), "the ranks set different biases"
    gate, x = _router_inputs(2)
    single = _balance(gate, x)
    assert single.abs().max() > 0.05, "the biases must have moved for the comparison to mean something"
    # the same histogram counts when every token's scores round alike; a differing bin moves a bias by ≤ 1 bin
    torch.testing.assert_close(got[0]["bias"], single, rtol=0, atol=2 * 2.0 / 1000)
    weights, grads = _matrices()
    m = _Params(weights)
    _steps(m, _optimizer(m), grads)
    for r in range(2):
        for k, p in m.named_parameters():
            torch.testing.assert_close(got[r]["params"][k], p.detach(), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(m.q, weights["q"]), "the optimiser must have moved the weights"
