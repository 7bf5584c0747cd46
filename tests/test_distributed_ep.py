"""Expert parallelism on 2 gloo processes equals the single-process LatentMoE in float64: outputs, the
gradient of the input and of every parameter (each rank's experts, and the replicated parts summed)."""

import torch

from dist_helpers import spawn
from k3 import K3Config
from k3.model.moe import LatentMoE
from k3.train.expert_parallel import shard_experts


def _moe() -> LatentMoE:
    torch.manual_seed(0)
    config = K3Config.from_preset("tiny")
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


def _ep_worker(rank: int, world: int, out_dir, token_counts: list[int]) -> None:
    for tokens in token_counts:
        moe = _moe()
        mine = shard_experts(moe, rank, world)
        x, w = _inputs(world, tokens, moe.routed_expert_down_proj.in_features)
        x = x[rank].clone().requires_grad_()
        y, _ = moe(x)
        (y * w[rank]).sum().backward()
        grads = {n: p.grad for n, p in moe.named_parameters() if p.grad is not None}
        result = {"y": y.detach(), "dx": x.grad, "grads": grads, "mine": list(mine)}
        torch.save(result, out_dir / f"t{tokens}_rank{rank}.pt")


def _check(out_dir, tokens: int, world: int) -> None:
    moe = _moe()
    x, w = _inputs(world, tokens, moe.routed_expert_down_proj.in_features)
    x = x.reshape(world * tokens, -1).requires_grad_()
    y, routing = moe(x)
    (y * w.reshape(world * tokens, -1)).sum().backward()
    assert (routing.loads_E > 0).sum() >= 2, "the test needs tokens for experts on both ranks"
    ref = dict(moe.named_parameters())
    summed: dict[str, torch.Tensor] = {}
    for rank in range(world):
        got = torch.load(out_dir / f"t{tokens}_rank{rank}.pt")
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
        expected = {n for n, p in ref.items() if ".experts." in n and p.grad is not None
                    and int(n.split(".experts.")[1].split(".")[0]) in got["mine"]}  # fmt: skip
        assert experts_with_grad == expected
    for name, grad in summed.items():
        torch.testing.assert_close(grad, ref[name].grad, rtol=1e-10, atol=1e-12)
    assert set(summed) == {n for n, p in ref.items() if ".experts." not in n and p.grad is not None}


def test_expert_parallel_equals_single_process_float64(tmp_path):
    # 24 tokens per rank; and 5, where some experts receive nothing and the ranks send unequal counts
    spawn(_ep_worker, tmp_path, tmp_path, [24, 5], world=2)
    for tokens in (24, 5):
        _check(tmp_path, tokens, world=2)
