"""LatentMoE (SPEC §2.3): routed experts work in a compressed latent, shared experts at full width.

    u = Σ_i w_i · Expert_i(W_down x)        y = Σ_j shared_j(x) + W_up · RMSNorm(u)

With routed_expert_hidden_size None the experts are full width, as in Kimi Linear and DeepSeek-V3: they read
and write x itself (no W_down, W_up or latent norm), y = Σ_j shared_j(x) + Σ_i w_i · Expert_i(x).

Shape suffixes: T tokens, D model width, L latent width (D for full-width experts), E experts, K chosen per
token, A assignments (T·K).
"""

import itertools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.norm import RMSNorm
from k3.model.router import Router, RouterOutput
from k3.model.situ import Expert, GatedMLP, glu, glu_backward, glu_parts
from k3.ops import moe_cpu
from k3.quant.mx import unpack_mxfp4
from k3.quant.packed_experts import MXFP4Linear
from k3.quant.qat import INPUT_FORMAT, fake_quantize, quantized_input, quantized_weight

# Above this many hidden activations (assignments × expert width) the experts run one whole chain each.
MERGE_ELEMENTS = 1 << 18
# k3::moe_experts runs the C++ kernel up to this many assignments per expert on average (decoding, prefill
# chunks); at training's batches ATen's per-expert matmuls and vectorised activation were faster (2,048 tokens of
# the small preset: 25.7 ms against 20.4 ms, 512 tokens: 6.6 against 11.6).
KERNEL_ROWS_PER_EXPERT = 128


class LatentMoE(nn.Module):
    """x (B, T, D) -> y (B, T, D) and the routing decision (for load balancing: K3Output.routing)."""

    def __init__(self, config: K3Config):
        super().__init__()
        D, L = config.hidden_size, config.expert_width
        self.act = (config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta)
        self.gate = Router(
            D, config.num_experts, config.num_experts_per_token, config.moe_renormalize, config.routed_scaling_factor
        )
        self.experts = nn.ModuleList(Expert(L, config.moe_intermediate_size) for _ in range(config.num_experts))
        if config.routed_expert_hidden_size is not None:  # the latent; full-width experts have none
            self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
            self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else nn.Identity()
            self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        self.quantization = config.expert_quantization  # None, or "mxfp4": MXFP4 weights, MXFP8 inputs
        if config.num_shared_experts:
            self.shared_experts = GatedMLP(D, config.moe_intermediate_size * config.num_shared_experts, *self.act)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        routing = self.gate(x_TD)
        latent = hasattr(self, "routed_expert_down_proj")
        z_TL = self.routed_expert_down_proj(x_TD) if latent else x_TD
        if torch.compiler.is_compiling() and self.plain_experts():
            # inside a compiled step: the experts behind one operator (their row counts decide the shapes of their
            # matmuls, which a graph cannot). Serving calls the C++ kernel itself where it loads, with no Python
            # between the graph and it; training calls k3::moe_experts, whose backward is its own operator.
            # under autocast z arrives in the autocast dtype, and an operator's inputs are not cast for it: the
            # weights are cast here, as F.linear's would be (a no-op otherwise)
            weights = [[ex.w1.weight.to(z_TL.dtype) for ex in self.experts]]
            weights.append([ex.w3.weight.to(z_TL.dtype) for ex in self.experts])
            weights.append([ex.w2.weight.to(z_TL.dtype) for ex in self.experts])
            if not torch.is_grad_enabled() and moe_cpu.usable(z_TL, weights[0][0]):
                scores = routing.weights_TK.to(z_TL.dtype)
                u_TL = torch.ops.k3_cpu.moe_experts(z_TL, routing.experts_TK, scores, *weights, *self.act)
            else:
                u_TL = torch.ops.k3.moe_experts(z_TL, routing.experts_TK, routing.weights_TK, *weights, *self.act)
        elif torch.compiler.is_compiling() and not torch.is_grad_enabled() and self.packed_experts():
            # the same seam for MXFP4-packed experts: the kernel reads the packed bytes, nothing is dequantised
            # (the graph names the layer by its handle instead of taking its 6·E byte tensors: Dynamo checks
            # every buffer a graph reads for aliasing at each call, ~4 µs apiece even with guards skipped)
            quantize_inputs = self.quantization == "mxfp4"
            if moe_cpu.usable_packed(z_TL):  # the C++ kernel, with the tensors it was given under the handle
                scores = routing.weights_TK.to(z_TL.dtype)
                u_TL = torch.ops.k3_cpu.moe_experts_mxfp4_layer(
                    z_TL, routing.experts_TK, scores, self.handle, *self.act, quantize_inputs
                )
            else:
                u_TL = torch.ops.k3.moe_experts_mxfp4(
                    z_TL, routing.experts_TK, routing.weights_TK, self.handle, *self.act, quantize_inputs
                )
        else:
            u_TL = self.dispatch(z_TL, routing)
        y_TD = self.routed_expert_up_proj(self.routed_expert_norm(u_TL)) if latent else u_TL
        if hasattr(self, "shared_experts"):
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD.view(shape), routing

    def plain_experts(self) -> bool:
        """Whether the experts are unquantised nn.Linear layers (what k3::moe_experts takes)."""
        return not self.quantization and all(type(ex.w1) is nn.Linear for ex in self.experts[:1])

    def packed_experts(self) -> bool:
        """Whether every routed expert projection is MXFP4-packed (what k3::moe_experts_mxfp4 takes)."""
        return all(isinstance(getattr(ex, w), MXFP4Linear) for ex in self.experts for w in ("w1", "w3", "w2"))

    @property
    def handle(self) -> int:
        """This layer's number in the registry k3::moe_experts_mxfp4 reads its packed experts from: given on
        the first eager read (a compiled graph reads the number as a constant: k3.serve.compiled_step reads it
        before tracing), and given anew to a copy of the layer, which must not compute with the original's."""
        if not torch.compiler.is_compiling():
            handle = self.__dict__.get("_handle")
            if handle is None or _layers.get(handle, _gone)() is not self:
                self._handle = next(_handles)
                _layers[self._handle] = weakref.ref(self)
                weakref.finalize(self, _forget, self._handle)
            self._keep_packed()
        elif "_handle" not in self.__dict__:
            raise RuntimeError("read LatentMoE.handle outside the compiled region before tracing packed experts")
        return self._handle

    def _keep_packed(self) -> None:
        """Hand the packed experts' tensors to the C++ kernel, which a compiled graph calls with the handle alone
        (gathering 6·E buffers per call cost more than the experts)."""
        if self.packed_experts():
            moe_cpu.set_packed_experts(self._handle, self.packed_buffers())

    def _apply(self, *args, **kwargs):
        out = super()._apply(*args, **kwargs)
        if "_handle" in self.__dict__:  # .to(device) gives the buffers new tensors
            self._keep_packed()
        return out

    def packed_buffers(self) -> list[list[torch.Tensor]]:
        """The packed experts' bytes and scales as k3::moe_experts_mxfp4 takes them: six lists (w1's bytes,
        w1's scales, w3's, w2's), one tensor per expert each."""
        layers = [[ex.w1 for ex in self.experts], [ex.w3 for ex in self.experts], [ex.w2 for ex in self.experts]]
        return [[getattr(m, b) for m in group] for group in layers for b in ("weight_packed", "weight_scale")]

    def dispatch(self, z_TL: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        """Σ_k w_tk · Expert_{e_tk}(z_t): assignments sorted by expert so each expert's tokens are one
        contiguous run, the experts applied run by run (`experts_forward`), the results weighted and summed
        back per token. Expert parallelism replaces only the middle step (the runs travel to the ranks that
        own their experts), so it computes exactly what this does."""
        return combine(z_TL, routing.experts_TK, routing.weights_TK, routing.loads_E.tolist(), self.experts_forward)

    def experts_forward(self, z_AL: torch.Tensor, counts: list[int], first: int = 0) -> torch.Tensor:
        """z_AL (A, L) sorted by expert, counts[i] rows for expert first + i -> h_AL (A, L), Expert(z) per row.

        Few rows (decoding, short prefill chunks): three matmuls per active expert and the activation once
        over all of them; per expert those were most of the ops of a decode step. Many (training): the whole
        chain per expert, so every temporary stays small and in cache; merged, the activation's multi-MB
        temporaries made a training step's MoE ~15% slower on CPU.

        With expert_quantization "mxfp4" (SPEC §2.8, k3.quant.qat) every expert matmul reads its weight as
        MXFP4 (fake-quantised master weight, or the packed bytes) and its input as MXFP8, quantised per row
        in blocks of 32, so the result of a row does not depend on which rows share the call.
        """
        active = [(self.experts[first + i], n) for i, n in enumerate(counts) if n]
        weight, x = (quantized_weight, quantized_input) if self.quantization else (_plain_weight, _identity)
        weights = [(weight(ex.w1), weight(ex.w3), weight(ex.w2)) for ex, _ in active]
        return run_experts(z_AL, [n for _, n in active], weights, self.act, x)


def combine(
    z_TL: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    counts: list[int],
    experts_forward: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> torch.Tensor:
    """Σ_k w_tk · Expert_{e_tk}(z_t), with experts_forward(z_AL, counts) applying the experts to the
    assignments sorted by expert (LatentMoE.dispatch). The weighted sum is taken in at least fp32 with the
    routing's fp32 weights and rounded to z's dtype once, as HF's and SGLang's MoE layers and k3's C++ kernel
    do: in bf16 the K = 16 partial sums each rounded to 8 bits."""
    acc = torch.promote_types(z_TL.dtype, torch.float32)
    _, tokens_A, weights_A = sort_assignments(experts_TK, weights_TK, acc)
    h_AL = experts_forward(z_TL.index_select(0, tokens_A), counts)
    u_TL = z_TL.new_zeros(z_TL.shape, dtype=acc).index_add_(0, tokens_A, h_AL.to(acc) * weights_A[:, None])
    return u_TL.to(z_TL.dtype)


def sort_assignments(
    experts_TK: torch.Tensor, weights_TK: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The T·K assignments sorted by expert, stably: (order_A, the flat assignment index of each; tokens_A, the
    token each belongs to; weights_A, its routing weight in dtype)."""
    order_A = experts_TK.flatten().argsort(stable=True)
    return order_A, order_A // experts_TK.shape[1], weights_TK.flatten()[order_A].to(dtype)


def run_experts(
    z_AL: torch.Tensor,
    sizes: list[int],
    weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    act: tuple[str, float, float],
    x: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """z_AL (A, L) in runs of sizes[i] rows for the i-th expert, whose (w1, w3, w2) weights are weights[i],
    inputs quantised by x -> h_AL (A, L) (LatentMoE.experts_forward)."""
    if not sizes:
        return z_AL.new_zeros(0, z_AL.shape[1])
    z_AL = x(z_AL)
    z_parts = z_AL.split(sizes)  # split: its backward is one cat
    if len(z_AL) * weights[0][0].shape[0] > MERGE_ELEMENTS:
        return torch.cat(
            [
                F.linear(x(glu(F.linear(z, w1), F.linear(z, w3), *act)), w2)
                for (w1, w3, w2), z in zip(weights, z_parts, strict=True)
            ]
        )
    gate_AI = torch.cat([F.linear(z, w1) for (w1, _, _), z in zip(weights, z_parts, strict=True)])
    up_AI = torch.cat([F.linear(z, w3) for (_, w3, _), z in zip(weights, z_parts, strict=True)])
    h_parts = x(glu(gate_AI, up_AI, *act)).split(sizes)
    return torch.cat([F.linear(h, w2) for (_, _, w2), h in zip(weights, h_parts, strict=True)])


@torch.library.custom_op("k3::moe_experts", mutates_args=())
def moe_experts(
    z_TL: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w1: list[torch.Tensor],
    w3: list[torch.Tensor],
    w2: list[torch.Tensor],
    act: str,
    beta1: float,
    beta2: float,
) -> torch.Tensor:
    """LatentMoE.dispatch as one operator, for unquantised experts given as their weights (w1[e], w3[e], w2[e]
    of expert e): z_TL (T, L), the routing's experts_TK and weights_TK -> u_TL (T, L). The seam a compiled
    graph calls, since the experts' row counts, read from the routing, decide the shapes of their matmuls.
    On the CPU it runs k3's C++ kernel (k3.ops.moe_cpu) where that loads; this path is its reference."""
    if moe_cpu.usable(z_TL, w1[0]) and experts_TK.numel() <= KERNEL_ROWS_PER_EXPERT * len(w1):
        return moe_cpu.moe_experts(z_TL, experts_TK, weights_TK, w1, w3, w2, act, beta1, beta2)
    counts = torch.bincount(experts_TK.flatten(), minlength=len(w1)).tolist()
    active = [e for e, n in enumerate(counts) if n]

    def experts_forward(z_AL: torch.Tensor, counts: list[int]) -> torch.Tensor:
        weights = [(w1[e], w3[e], w2[e]) for e in active]
        return run_experts(z_AL, [counts[e] for e in active], weights, (act, beta1, beta2), _identity)

    return combine(z_TL, experts_TK, weights_TK, counts, experts_forward)


@moe_experts.register_fake
def _(z_TL, experts_TK, weights_TK, w1, w3, w2, act, beta1, beta2) -> torch.Tensor:
    return torch.empty_like(z_TL)


@torch.library.custom_op("k3::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    du_TL: torch.Tensor,
    z_TL: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w1: list[torch.Tensor],
    w3: list[torch.Tensor],
    w2: list[torch.Tensor],
    act: str,
    beta1: float,
    beta2: float,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The gradients of k3::moe_experts given du_TL (T, L): (dz_TL, dweights_TK, dw1, dw3, dw2), each weight's
    gradient zero for an expert no token chose (k3.train.compiled.IdleExperts turns those back into None). Each
    expert's gate and up products are recomputed from its rows (two of the layer's nine expert products, where
    keeping them would hold (A, 2I) per layer until the backward), then differentiated by hand, so the operator
    holds no autograd graph and a compiled training step calls it as one node, like the forward."""
    order_A, tokens_A, weights_A = sort_assignments(experts_TK, weights_TK, z_TL.dtype)
    counts = torch.bincount(experts_TK.flatten(), minlength=len(w1)).tolist()
    z_AL = z_TL.index_select(0, tokens_A)
    du_AL = du_TL.index_select(0, tokens_A)
    dz_AL = torch.empty_like(z_AL)
    dweights_A = torch.empty(len(order_A), dtype=z_TL.dtype, device=z_TL.device)
    grads: list[list[torch.Tensor]] = [[], [], []]
    start = 0
    for e, n in enumerate(counts):
        if not n:
            for g, w in zip(grads, (w1, w3, w2), strict=True):
                g.append(torch.zeros_like(w[e]))
            continue
        rows = slice(start, start + n)
        start += n
        z, du, weight = z_AL[rows], du_AL[rows], weights_A[rows, None]
        gate, up = z @ w1[e].t(), z @ w3[e].t()  # two products: tanh on a strided half of one costs more
        h, parts = glu_parts(gate, up, act, beta1, beta2)
        dh = du @ w2[e]  # the expert output's gradient before the routing weight, through w2
        dweights_A[rows] = (dh * h).sum(-1)  # ∂u_t/∂w_tk · du_t = Expert(z_t) · du_t = (du_t w2) · h
        grads[2].append((du * weight).t() @ h)
        dgate, dup = glu_backward(parts, dh.mul_(weight), act, beta1, beta2)
        grads[0].append(dgate.t() @ z)
        grads[1].append(dup.t() @ z)
        dz_AL[rows] = torch.addmm(dgate @ w1[e], dup, w3[e])
    dz_TL = torch.zeros_like(z_TL).index_add_(0, tokens_A, dz_AL)
    dweights_TK = torch.empty_like(dweights_A).index_copy_(0, order_A, dweights_A).view(experts_TK.shape)
    return dz_TL, dweights_TK.to(weights_TK.dtype), *grads


@moe_experts_backward.register_fake
def _(du_TL, z_TL, experts_TK, weights_TK, w1, w3, w2, act, beta1, beta2):
    grads = [[torch.empty_like(w) for w in ws] for ws in (w1, w3, w2)]
    return torch.empty_like(z_TL), torch.empty_like(weights_TK), *grads


def _moe_experts_setup(ctx, inputs, output) -> None:
    z_TL, experts_TK, weights_TK, w1, w3, w2, act, beta1, beta2 = inputs
    ctx.save_for_backward(z_TL, experts_TK, weights_TK, *w1, *w3, *w2)
    ctx.act = (act, beta1, beta2)


def _moe_experts_grad(ctx, du_TL: torch.Tensor):
    z_TL, experts_TK, weights_TK, *w = ctx.saved_tensors
    E = len(w) // 3
    w1, w3, w2 = w[:E], w[E : 2 * E], w[2 * E :]
    dz, dweights, dw1, dw3, dw2 = moe_experts_backward(du_TL, z_TL, experts_TK, weights_TK, w1, w3, w2, *ctx.act)
    return dz, None, dweights, dw1, dw3, dw2, None, None, None


# training through the operator: a compiled training step keeps the experts as two nodes, forward and backward
moe_experts.register_autograd(_moe_experts_grad, setup_context=_moe_experts_setup)


# LatentMoE.handle -> the layer, for k3::moe_experts_mxfp4 (weak: the registry keeps no model alive)
_layers: dict[int, weakref.ref] = {}
_handles = itertools.count()


def _gone() -> None:
    return None


def _forget(handle: int) -> None:
    """A LatentMoE was collected: its registry entry and the tensors the C++ kernel kept for it go."""
    _layers.pop(handle, None)
    moe_cpu.drop_packed_experts(handle)


@torch.library.custom_op("k3::moe_experts_mxfp4", mutates_args=())
def moe_experts_mxfp4(
    z_TL: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    layer: int,
    act: str,
    beta1: float,
    beta2: float,
    quantize_inputs: bool,
) -> torch.Tensor:
    """moe_experts for the MXFP4-packed experts (k3.quant.MXFP4Linear) of the LatentMoE whose handle is `layer`:
    each active expert's weights dequantised and applied, its inputs MXFP8-quantised when quantize_inputs
    (expert_quantization "mxfp4"), as LatentMoE.experts_forward computes them. On the CPU it runs k3's C++ kernel
    (k3.ops.moe_cpu), which reads the packed bytes in place, where that loads; this path is its reference."""
    moe = _layers.get(layer, _gone)()
    if moe is None:
        raise RuntimeError(f"k3::moe_experts_mxfp4: no LatentMoE has handle {layer} (the model is gone)")
    packed = moe.packed_buffers()
    if moe_cpu.usable_packed(z_TL):
        return moe_cpu.moe_experts_mxfp4(z_TL, experts_TK, weights_TK, packed, act, beta1, beta2, quantize_inputs)
    p1, s1, p3, s3, p2, s2 = packed
    counts = torch.bincount(experts_TK.flatten(), minlength=len(p1)).tolist()
    active = [e for e, n in enumerate(counts) if n]
    x = _quantized_input if quantize_inputs else _identity

    def experts_forward(z_AL: torch.Tensor, counts: list[int]) -> torch.Tensor:
        weights = [
            tuple(unpack_mxfp4(p[e], s[e], z_TL.dtype) for p, s in ((p1, s1), (p3, s3), (p2, s2))) for e in active
        ]
        return run_experts(z_AL, [counts[e] for e in active], weights, (act, beta1, beta2), x)

    return combine(z_TL, experts_TK, weights_TK, counts, experts_forward)


@moe_experts_mxfp4.register_fake
def _(z_TL, experts_TK, weights_TK, layer, act, beta1, beta2, quantize_inputs) -> torch.Tensor:
    return torch.empty_like(z_TL)


def _quantized_input(x: torch.Tensor) -> torch.Tensor:
    return fake_quantize(x, INPUT_FORMAT)


def _plain_weight(layer: nn.Module) -> torch.Tensor:
    return layer.weight


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
