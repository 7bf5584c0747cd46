"""The short causal convolution + SiLU that KDA applies to q, k and v (SPEC §2.1).

y_t = silu(Σ_j w_j · x_{t+j−(w−1)}) per channel, inputs before t = 0 read from the tail (zeros when
there is none). `causal_conv_reference` writes it as the padded sum of shifted products; the fast path
(`causal_conv`) is a `torch.autograd.Function` whose backward is written by hand, so training does not
pay autograd's padded copies (one zero-filled (B, T+w−1, C) gradient per tap plus the concatenation's).
"""

import torch
import torch.nn.functional as F

from k3.ops.autograd import first_derivative_only


def causal_conv_reference(
    x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain formula; also the decoding path (T = 1) of `causal_conv`.

    x: (B, T, C); weight: (C, 1, w) as nn.Conv1d keeps it; tail: (B, C, w−1) inputs preceding x (zeros
    when None). returns y (B, T, C) and the new tail (B, C, w−1), the last w−1 inputs.
    """
    B, T, C = x.shape
    w = weight.shape[-1]
    past = tail.transpose(1, 2).to(x.dtype) if tail is not None else x.new_zeros(B, w - 1, C)
    full = torch.cat([past, x], dim=1)  # (B, w−1+T, C)
    taps = weight.view(C, w).t()  # (w, C): tap j multiplies the input j steps into the window
    # one window (decoding): one product and one sum; else one shifted product per tap
    y = (full * taps).sum(1, keepdim=True) if T == 1 else sum(full[:, j : j + T] * taps[j] for j in range(w))
    return F.silu(y), full[:, full.shape[1] - (w - 1) :].transpose(1, 2)


def _pre_activation(x: torch.Tensor, taps: torch.Tensor, past: torch.Tensor | None) -> torch.Tensor:
    """Σ_j taps_j · x_{t+j−(w−1)} without padding: tap j = w−1−s adds x shifted s steps later, in place on
    the in-range rows, and the past's values on the first min(s, T) rows.

    x (B, T, C), any strides; taps (w, C); past (B, w−1, C) or None -> a new contiguous (B, T, C) tensor.
    """
    T, w = x.shape[1], taps.shape[0]
    pre = torch.mul(x, taps[w - 1], out=x.new_empty(x.shape))
    for s in range(1, w):
        if s < T:
            pre[:, s:].addcmul_(x[:, : T - s], taps[w - 1 - s])
        if past is not None:
            m = min(s, T)
            pre[:, :m].addcmul_(past[:, w - 1 - s : w - 1 - s + m], taps[w - 1 - s])
    return pre


class _ShortConvSiLU(torch.autograd.Function):
    """silu(depthwise causal conv) with the backward by hand.

    Saves x (a view of the projection's output, which the graph keeps anyway), the taps and the small
    past. The pre-activation is recomputed in the backward (w multiply-adds) rather than kept as a
    (B, T, C) tensor per layer until the backward, so the graph holds less than autograd's composite
    (the padded input and the pre-activation).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None) -> torch.Tensor:
        taps = weight.view(weight.shape[0], -1).t().contiguous()  # (w, C)
        ctx.save_for_backward(x, taps, past)
        return F.silu(_pre_activation(x, taps, past), inplace=True)

    @staticmethod
    @first_derivative_only
    def backward(ctx, dy: torch.Tensor):
        x, taps, past = ctx.saved_tensors
        T, w = x.shape[1], taps.shape[0]
        # g = dy · silu'(pre) = dy · s · (1 + pre · (1 − s)), s = sigmoid(pre), formed in place in two fresh
        # buffers (aten's silu_backward takes about twice as long on CPU)
        pre = _pre_activation(x, taps, past)
        g = torch.sigmoid(pre)
        pre.addcmul_(pre, g, value=-1).add_(1)
        g.mul_(dy).mul_(pre)
        dx = dweight = dpast = None
        if ctx.needs_input_grad[0]:
            # dx_t = Σ_s taps_{w−1−s} · g_{t+s}: the forward's shifts transposed
            dx = g * taps[w - 1]
            for s in range(1, min(w, T)):
                dx[:, : T - s].addcmul_(g[:, s:], taps[w - 1 - s])
        if ctx.needs_input_grad[1]:
            # dtaps_j = Σ_{b,t} g_t · x_{t−s}: products into the spent pre buffer, its first s rows zeroed,
            # then one reduction over the contiguous rows (a reduction over a row slice is ~10x slower)
            prod = pre.view(-1, pre.shape[-1])
            dtaps = taps.new_zeros(taps.shape)
            compiling = torch.compiler.is_compiling()  # Dynamo takes no out= into a strided view
            for s in range(min(w, T)):
                if compiling:  # Inductor fuses the product into the sum anyway
                    dtaps[w - 1 - s] = (g[:, s:] * x[:, : T - s]).sum((0, 1))
                    continue
                pre[:, :s].zero_()
                torch.mul(g[:, s:], x[:, : T - s], out=pre[:, s:])
                dtaps[w - 1 - s] = prod.sum(0)
            if past is not None:
                for s in range(1, w):
                    m = min(s, T)
                    dtaps[w - 1 - s] += (g[:, :m] * past[:, w - 1 - s : w - 1 - s + m]).sum((0, 1))
            dweight = dtaps.t().reshape(taps.shape[1], 1, w)
        if past is not None and ctx.needs_input_grad[2]:
            dpast = torch.zeros_like(past)
            for s in range(1, w):
                m = min(s, T)
                dpast[:, w - 1 - s : w - 1 - s + m].addcmul_(g[:, :m], taps[w - 1 - s])
        return dx, dweight, dpast


def causal_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution + SiLU over time.

    x: (B, T, C); weight: (C, 1, w) as nn.Conv1d keeps it; tail: (B, C, w−1) inputs preceding x (zeros
    when None). returns y (B, T, C) and the new tail (B, C, w−1), the last w−1 inputs, for the next call.

    Written as w shifted multiply-adds (a tiny kernel over many channels, where CPU conv1d's backward
    loops over channels one by one), with a hand-written backward. Decoding (T = 1) and mixed dtypes take
    the reference's composite form; y is in x's dtype.
    """
    B, T, C = x.shape
    if weight.dim() != 3 or weight.shape[:2] != (C, 1):
        raise ValueError(
            f"causal_conv: weight must be (C, 1, kernel) = ({C}, 1, w) for x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    w = weight.shape[-1]
    if tail is not None and tail.shape != (B, C, w - 1):
        raise ValueError(f"causal_conv: tail must be (B, C, kernel − 1) = ({B}, {C}, {w - 1}), got {tuple(tail.shape)}")
    if T == 1 or x.dtype != weight.dtype:
        # mixed dtypes: fp32 taps of a bf16 model (k3.model.model.KEEP_FP32) or master weights under autocast;
        # computed in the wider dtype and returned in x's, as fla's and HF's short convolutions do
        y, tail = causal_conv_reference(x, weight, tail)
        return y.to(x.dtype), tail
    past = tail.transpose(1, 2).to(x.dtype) if tail is not None else None  # (B, w−1, C)
    y = _ShortConvSiLU.apply(x, weight, past)
    # the last w−1 inputs, copied so a cache does not keep the whole projection output alive
    if w - 1 <= T:
        last = x[:, T - (w - 1) :]
    else:
        last = torch.cat([past if past is not None else x.new_zeros(B, w - 1, C), x], dim=1)[:, T:]
    return y, last.transpose(1, 2).contiguous()
