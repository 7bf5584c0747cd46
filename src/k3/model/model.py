"""The K3 language model: embedding, 93 hybrid layers (KDA : MLA = 3 : 1, a final MLA), dense
first FFN then LatentMoE, Block Attention Residuals across depth, final norm, untied LM head.

`K3Model.state_dict()` uses the released checkpoint's names: `model.*` and `lm_head.weight`.
With a vision_config it also holds the release's `vision_tower.*` and `mm_projector.*` (k3.model.vision).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from k3.config import K3Config
from k3.model.attn_res import AttnResStream, ResidualStream
from k3.model.cache import K3Cache
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.moe import LatentMoE
from k3.model.norm import RMSNorm
from k3.model.router import RouterOutput
from k3.model.situ import GatedMLP
from k3.model.vision import PatchMergerProjector, VisionTower, place_image_tokens
from k3.ops.cross_entropy import cross_entropy
from k3.ops.numerics import at_least_fp32

# Tensors a bf16 model keeps in fp32, as the release stores them (F32 beside its bf16 matrices). Each is small and
# sets a per-channel scale or rate (exp(A_log), softplus(· + dt_bias), the short
# convolutions' taps, the gated norm's gain) where bf16's 8 bits would move every token's result; the code that
# reads them computes in fp32 already. Names as the state dict ends them.
KEEP_FP32 = ("conv1d.weight", "o_norm.weight", "A_log", "dt_bias")


@dataclass
class K3Output:
    logits: torch.Tensor  # (B, T, vocab)
    loss: torch.Tensor | None = None  # mean next-token cross-entropy when labels are given
    routing: list[RouterOutput] | None = None  # one per MoE layer, in layer order
    # the AttnRes block summaries forward(summaries=…) asked for, (B, T or n, d) each (at logits_at when given)
    summaries: list[torch.Tensor] | None = None


class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, index: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.index, self.kind = index, config.layer_types[index]
        self.activation_checkpointing = False  # K3Model.set_activation_checkpointing
        self.self_attn = GatedMLA(config) if self.kind == "mla" else KimiDeltaAttention(config)
        if config.ffn_types[index] == "dense":
            self.mlp = GatedMLP(
                d,
                config.intermediate_size,
                config.hidden_act,
                config.activation_situ_beta,
                config.activation_situ_linear_beta,
            )
        else:
            self.block_sparse_moe = LatentMoE(config)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if config.residual == "attnres":
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, eps)

    def res_query(self, sublayer: str) -> tuple[nn.Linear, RMSNorm] | None:
        """The AttnRes pseudo-query and key norm before `sublayer` ("self_attention" or "mlp"); None
        under standard residuals."""
        if not hasattr(self, f"{sublayer}_res_proj"):
            return None
        return getattr(self, f"{sublayer}_res_proj"), getattr(self, f"{sublayer}_res_norm")

    def forward(self, stream: ResidualStream | AttnResStream, cache=None) -> RouterOutput | None:
        """Attention then FFN, each pre-normed, reading from and adding to the residual stream (updated in
        place). Returns the MoE's routing decision (None for a dense FFN), for load balancing."""
        stream.begin_layer(self.index)
        stream.add(self._sublayer(self._attention, stream.input(self.res_query("self_attention")), cache))
        out, routing = self._sublayer(self._ffn, stream.input(self.res_query("mlp")))
        stream.add(out)
        return routing

    def _attention(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x), cache)

    def _ffn(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterOutput | None]:
        h = self.post_attention_layernorm(x)
        return (self.mlp(h), None) if hasattr(self, "mlp") else self.block_sparse_moe(h)

    def _sublayer(self, fn, x: torch.Tensor, *args):
        """fn(x, *args), or with activation checkpointing (training, no cache) only x is kept and the
        sublayer's activations are recomputed in the backward: memory per layer drops to its input."""
        if self.activation_checkpointing and torch.is_grad_enabled() and not any(a is not None for a in args):
            return torch.utils.checkpoint.checkpoint(fn, x, *args, use_reentrant=False)
        return fn(x, *args)


class K3TextModel(nn.Module):
    """input_ids (B, T) -> final hidden states (B, T, d) after the last AttnRes readout and norm, and the
    routing decision of every MoE layer in layer order."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.residual == "attnres":
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
            self.output_attn_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_starts = {s for s, _ in config.attn_res_blocks}

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: K3Cache | None = None,
        image_embeds: torch.Tensor | None = None,
        summaries: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[RouterOutput], list[torch.Tensor]]:
        """... -> hidden (B, T, d), routing, and the AttnRes block summaries numbered in `summaries` (1-based,
        AttnResStream.summaries: b₁ … b_final), (B, T, d) each."""
        x = self.embed_tokens(input_ids)
        if image_embeds is not None:  # vision tokens replace the placeholders' embeddings (k3.model.vision)
            x = place_image_tokens(x, input_ids, image_embeds, self.config.vision_config.media_placeholder_token_id)
        caches = cache.layers if cache is not None else [None] * len(self.layers)
        if self.config.residual == "standard":
            stream, readout = ResidualStream(x), None
        else:
            stream = AttnResStream(x, self.block_starts)
            readout = (self.output_attn_res_proj, self.output_attn_res_norm)
        routing = []
        for layer, c in zip(self.layers, caches, strict=True):  # a loop: Dynamo cannot trace := in a comprehension
            r = layer(stream, c)
            if r is not None:
                routing.append(r)
        if summaries and not isinstance(stream, AttnResStream):
            raise ValueError("block summaries are AttnRes's; this model has standard residuals")
        blocks = stream.summaries() if summaries else []
        return self.norm(stream.readout(readout)), routing, [blocks[b - 1] for b in summaries]


class K3Model(nn.Module):
    """The causal LM. model(input_ids, cache=None, labels=None, logits_at=None) -> K3Output."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.model = K3TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if config.vision_config is not None:  # the release's top-level vision_tower.* and mm_projector.*
            self.vision_tower = VisionTower(config.vision_config)
            self.mm_projector = PatchMergerProjector(config.vision_config)
        self.reset_parameters()

    def encode_images(self, images: list[torch.Tensor]) -> torch.Tensor:
        """images [(3, H, W)], packed through the vision tower and projector -> (tokens, hidden_size): each
        image's (H/28)·(W/28) tokens (patch 14, 2x2 merge) in order, for forward's image_embeds."""
        if self.config.vision_config is None:
            raise ValueError("this model has no vision tower (its config has no vision_config): it takes text only")
        return self.mm_projector(*self.vision_tower(images))

    def cast(self, dtype: torch.dtype) -> "K3Model":
        """The model's floating-point parameters and buffers in dtype, except KEEP_FP32's, which a narrower
        dtype leaves in fp32 (a wider one, fp64, takes them too). In place; returns the model."""
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            target = torch.promote_types(dtype, torch.float32) if name.endswith(KEEP_FP32) else dtype
            if tensor.dtype != target:
                tensor.data = tensor.data.to(target)
        return self

    def set_activation_checkpointing(self, enabled: bool = True) -> "K3Model":
        """Recompute each sublayer's activations (attention, FFN/MoE) in the backward instead of keeping
        them: training memory per layer drops to the sublayers' inputs, at one more forward of compute.
        Results are unchanged (the recomputation is the same arithmetic)."""
        for layer in self.model.layers:
            layer.activation_checkpointing = enabled
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) matrices, unit norm gains, zero AttnRes queries and router bias,
        fla's KDA gate init. A no-op on the meta device."""
        if self.lm_head.weight.is_meta:
            return
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if name.endswith("_res_proj"):
                    nn.init.zeros_(module.weight)
                else:
                    nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.Conv1d):
                nn.init.normal_(module.weight, std=module.weight.shape[-1] ** -0.5)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, KimiDeltaAttention):
                module.reset_gate_parameters()
        for module in self.modules():
            if isinstance(module, LatentMoE):
                nn.init.normal_(module.gate.weight, std=std)
                module.gate.e_score_correction_bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: K3Cache | None = None,
        labels: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        summaries: tuple[int, ...] = (),
    ) -> K3Output:
        """logits_at: (n,) positions along T; only their logits are computed, (B, n, vocab): a serving
        step needs one position per sequence, and the LM head is the widest matmul of a small model.
        image_embeds: (n_placeholders, hidden_size) from encode_images, one row per placeholder token in
        input_ids (row-major over the batch).
        summaries: 1-based indices of AttnRes block summaries to return as well (what a speculative draft reads,
        k3.spec.features), at logits_at when given."""
        hidden, routing, blocks = self.model(input_ids, cache, image_embeds, summaries)
        if cache is not None:
            cache.seq_len += input_ids.shape[1]
        if logits_at is not None:
            if labels is not None:
                raise ValueError("labels need the logits of every position: do not pass logits_at with them")
            hidden = hidden[:, logits_at]
            blocks = [b[:, logits_at] for b in blocks]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            # predict token t+1 from position t; -100 marks positions without a target. The labels move, not
            # the logits: slicing off the last position would copy the (B, T, vocab) logits, and its backward
            # would fill and copy a tensor of that size again.
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            loss = cross_entropy(at_least_fp32(logits).flatten(0, 1), targets.flatten(), ignore_index=-100)
        return K3Output(logits, loss, routing, blocks if summaries else None)
