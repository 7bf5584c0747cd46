"""Plain autoregressive generation with the model's cache, for tests and examples. The serving
engine (paged pool, batching, prefix caching) is separate."""

import torch

from k3.model.cache import K3Cache
from k3.model.model import K3Model
from k3.model.sampling import filtered_probs


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, vocab) -> token ids (B,). temperature 0 is greedy; top_p keeps the smallest set of
    most likely tokens whose probability reaches top_p (the engine's filter, with top-k off)."""
    if temperature == 0:
        return logits.argmax(-1)
    B, V = logits.shape
    top_k = torch.full((B,), V, device=logits.device)
    top_p_B = torch.full((B,), top_p, dtype=torch.float32, device=logits.device)
    probs = filtered_probs(logits.float() / temperature, top_k, top_p_B)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: K3Model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | None = None,
    image_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """input_ids (B, T) -> (B, T + n) with n ≤ max_new_tokens (stops early once every row has emitted
    eos_token_id; rows that finished first are padded with it). image_embeds: model.encode_images(...) for
    the image placeholders in input_ids."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, T] with T >= 1, got shape {list(input_ids.shape)}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    cache = K3Cache.empty(model.config)
    logits = model(input_ids, cache=cache, image_embeds=image_embeds).logits[:, -1]
    out, done = [input_ids], torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        token = sample(logits, temperature, top_p, generator)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done |= token == eos_token_id
        out.append(token[:, None])
        if done.all():
            break
        logits = model(token[:, None], cache=cache).logits[:, -1]
    return torch.cat(out, dim=1)
