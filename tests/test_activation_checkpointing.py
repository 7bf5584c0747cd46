"""Activation checkpointing per sublayer: the same loss and gradients, bitwise, with less kept for the
backward; and `k3 train --activation-checkpointing` logs the same losses."""

import json

import torch

from k3 import K3Config, K3Model
from k3.cli import main


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
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"m{i}.py").write_text("".join(f"def f_{i}_{j}(x):\n    return x * {j}\n" for j in range(6)))
    args = ["train", "--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--vocab-size", "300",
            "--steps", "3", "--warmup", "1", "--eval-every", "3", "--eval-batches", "1", "--no-progress",
            "--data", str(corpus)]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "plain")]) == 0
    assert main([*args, "--out", str(tmp_path / "ckpt"), "--activation-checkpointing"]) == 0

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert losses(tmp_path / "plain") == losses(tmp_path / "ckpt")
