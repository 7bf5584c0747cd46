"""Mean token cross-entropy over a vocabulary, with a hand-written backward.

    loss = mean over rows with a target of  logsumexp(z_n) − z_n[y_n]
    ∂loss/∂z_n = (softmax(z_n) − onehot(y_n)) / count        (0 for rows whose target is ignore_index)

The same value and gradient as `F.cross_entropy(z, y, ignore_index=...)` (`reference` below), which runs
log_softmax (saving an N × vocab log-probability tensor for its backward), then nll_loss, whose backward
fills an N × vocab zero tensor and scatters into it before log_softmax's backward reads both. Here the
forward keeps only the logits (which the LM head produced anyway) and one log-sum-exp per row, and the
backward writes the gradient once. On a CPU both work on blocks of rows of about 4 MiB: a whole-tensor
logsumexp allocates vocabulary-wide temporaries, and on a CPU the first touch of each fresh page of those
costs as much as the arithmetic. On a small model's training step the vocabulary-wide tensors are its
largest; this takes the loss's forward+backward from 0.22 to ~0.1 s at 8192 × 8192 (2 threads) and keeps
one N × vocab tensor less.
"""

import torch
import torch.nn.functional as F

from k3.ops.autograd import first_derivative_only


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        valid = targets != ignore_index
        count = valid.sum()
        # ignored rows read column 0; any other target out of range makes gather raise, as torch's loss does
        columns = targets.masked_fill(~valid, 0)[:, None]  # (N, 1)
        lse = _logsumexp(logits)  # (N,)
        picked = logits.gather(1, columns).squeeze(1)
        loss = torch.where(valid, lse - picked, 0.0).sum() / count  # nan when nothing is valid, as torch's
        ctx.save_for_backward(logits, columns, lse, valid, count)
        return loss

    @staticmethod
    @first_derivative_only
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, columns, lse, valid, count = ctx.saved_tensors
        # per-row scale: g / count for rows with a target, 0 for the rest (and for all when count is 0)
        scale = torch.where(valid, grad_loss / count.clamp(min=1), 0.0).to(logits.dtype)  # (N,)
        grad = torch.empty_like(logits)
        step = _rows(logits)
        for start in range(0, len(logits), step):  # softmax · scale, one block of rows in cache at a time
            rows = slice(start, start + step)
            torch.sub(logits[rows], lse[rows, None], out=grad[rows]).exp_().mul_(scale[rows, None])
        grad.scatter_add_(1, columns, -(valid.to(grad.dtype) * scale)[:, None])
        return grad, None, None


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """(N, vocab) -> (N,), block by block through one reused buffer (torch.logsumexp allocates its
    temporaries per call: twice the time here). A row's max is taken as 0 when infinite, as torch's."""
    lse = logits.new_empty(len(logits))
    step = _rows(logits)
    buf = logits.new_empty(min(step, len(logits)), logits.shape[1])
    for start in range(0, len(logits), step):
        block = logits[start : start + step]
        top = block.amax(-1, keepdim=True)
        top.masked_fill_(top.isinf(), 0)
        out = lse[start : start + step]
        torch.sum(torch.sub(block, top, out=buf[: len(block)]).exp_(), -1, out=out)
        out.log_().add_(top.squeeze(-1))
    return lse


def _rows(logits: torch.Tensor) -> int:
    """Rows per block: about 4 MiB of logits on a CPU (cache-sized); every row at once elsewhere, where a
    block costs kernel launches (6 rows a block at a 163,840-token vocabulary) and nothing is gained."""
    if logits.device.type != "cpu":
        return max(1, len(logits))
    return max(1, (1 << 22) // (logits.shape[1] * logits.element_size()))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """logits (N, vocab) float, targets (N,) int64 in [0, vocab) or ignore_index -> the mean loss, a 0-dim tensor
    (nan when every target is ignored, with a zero gradient, as F.cross_entropy)."""
    if logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy takes logits (N, vocab) and targets (N,); got {tuple(logits.shape)} "
            f"and {tuple(targets.shape)}"
        )
    return _CrossEntropy.apply(logits, targets, ignore_index)


def reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """torch's own, for tests."""
    return F.cross_entropy(logits, targets, ignore_index=ignore_index)
