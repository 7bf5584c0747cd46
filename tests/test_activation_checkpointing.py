"""Activation checkpointing per sublayer: the same loss and gradients, bitwise, with less kept for the
backward; and `k3 train --activation-checkpointing` logs the same losses."""

import torch

from k3 import K3Config, K3Model
from k3.cli import main
from tiny_runs import logged_losses, tiny_train_args


def loss_grads_and_saved_bytes(model: K3Model, tokens: torch.Tensor):
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels=tokens).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, saved[0]


def test_same_loss_and_gradients_with_less_kept():
    torch.manual_seed(0)
    model = K3Model(K3Config.from_preset("tiny")).double()
    with torch.no_grad():  # non-zero AttnRes queries, so the mixing that stays outside the checkpoints matters
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.normal_(std=0.5)
    tokens = torch.randint(0, 512, (2, 70), generator=torch.Generator().manual_seed(1))
    loss, grads, kept = loss_grads_and_saved_bytes(model, tokens)
    model.set_activation_checkpointing(True)
    loss_ckpt, grads_ckpt, kept_ckpt = loss_grads_and_saved_bytes(model, tokens)
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys() and len(grads) > 200
    for name in grads:
        assert torch.equal(grads[name], grads_ckpt[name]), name
    assert kept_ckpt < kept / 2, (kept, kept_ckpt)
    with torch.no_grad():  # inference never checkpoints (nothing is kept anyway)
        assert torch.equal(model(tokens).logits, model.set_activation_checkpointing(False)(tokens).logits)


def test_train_flag_gives_the_same_losses(tmp_path):
    args = tiny_train_args(tmp_path)
    assert main([*args, "--out", str(tmp_path / "plain")]) == 0
    assert main([*args, "--out", str(tmp_path / "ckpt"), "--activation-checkpointing"]) == 0
    assert logged_losses(tmp_path / "plain") == logged_losses(tmp_path / "ckpt")
