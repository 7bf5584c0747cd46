"""Images in the serving engine: each image token gets an id that names the image by its content.

The engine's prefix cache hashes token ids, and every image token of every image is the same placeholder
id in the model's vocabulary: hashed as it is, two prompts that differ only in their image would share
cached pages. So a request does not carry placeholders. `ImageStore.add(pixels)` encodes the image once
(the model's tower and projector) and returns one *image token id* per image token, above the vocabulary:

    id = vocab_size + content_key · MAX_IMAGE_TOKENS + k        k = 0 .. n-1, the image's k-th token

content_key is 40 bits of a hash of the pixel values and shape, so the same image in two requests gives
the same ids (a prefix-cache hit over it) and another image other ids (a miss). Before the forward, the
model runner turns them back (`resolve`): placeholder ids for the model's embedding, and the stored
embedding rows, in order, for forward's image_embeds. Sampling never produces these ids (the LM head
covers the vocabulary only), and they are never decoded: they sit in prompts only.

The store keeps the most recently added `capacity` images; a request whose image was dropped before its
prefill ran fails with a message saying so. One lock guards it: requests are added from callers' threads
while the engine's loop thread resolves.
"""

import hashlib
import threading
from collections import OrderedDict

import torch

from k3.model.model import K3Model

MAX_IMAGE_TOKENS = 1 << 16  # image tokens one image may have (the id space of one content key)
KEY_BITS = 40
DEFAULT_CAPACITY = 64  # images kept encoded
DEFAULT_MAX_IMAGE_TOKENS = 256  # an encoded image is resized to at most this many tokens (k3.data.image_input)


class ImageStore:
    def __init__(self, model: K3Model, capacity: int = DEFAULT_CAPACITY):
        if model.config.vision_config is None:
            raise ValueError("this model has no vision tower (its config has no vision_config): it takes text only")
        self.model, self.capacity = model, capacity
        self.vocab_size = model.config.vocab_size
        self.placeholder_id = model.config.vision_config.media_placeholder_token_id
        self._embeds: OrderedDict[int, torch.Tensor] = OrderedDict()  # content key -> (n, d)
        self._lock = threading.Lock()

    @staticmethod
    def content_key(pixels: torch.Tensor) -> int:
        h = hashlib.blake2b(digest_size=8)
        h.update(repr(tuple(pixels.shape)).encode())
        h.update(pixels.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return int.from_bytes(h.digest(), "little") >> (64 - KEY_BITS)

    @torch.no_grad()
    def add(self, pixels: torch.Tensor) -> list[int]:
        """pixels (3, H, W) (k3.data.image_input.image_to_tensor) -> its image token ids (module docstring)."""
        key = self.content_key(pixels)
        with self._lock:
            embeds = self._embeds.get(key)
            if embeds is not None:
                self._embeds.move_to_end(key)
        if embeds is None:
            device = next(self.model.parameters()).device
            embeds = self.model.encode_images([pixels.to(device)])
            if embeds.shape[0] > MAX_IMAGE_TOKENS:
                raise ValueError(f"an image of {embeds.shape[0]} tokens; at most {MAX_IMAGE_TOKENS} per image")
            with self._lock:
                self._embeds[key] = embeds
                while len(self._embeds) > self.capacity:
                    self._embeds.popitem(last=False)
        base = self.vocab_size + key * MAX_IMAGE_TOKENS
        return list(range(base, base + embeds.shape[0]))

    def add_encoded(self, data: bytes, max_tokens: int = DEFAULT_MAX_IMAGE_TOKENS) -> list[int]:
        """An encoded image (PNG, JPEG, ...) checked and resized by k3.data.image_input (an ImageError, a
        ValueError, says what is wrong with it) -> its image token ids."""
        from k3.data.image_input import image_to_tensor, load_image

        return self.add(image_to_tensor(load_image(data), self.model.config.vision_config, max_tokens))

    def check(self, token_ids: list[int]) -> None:
        """A ValueError unless every id above the vocabulary names a stored image's token (add_request's check:
        an unknown id found later, in the engine's step, would fail every request of that step)."""
        with self._lock:
            for t in token_ids:
                if t >= self.vocab_size:
                    key, k = divmod(t - self.vocab_size, MAX_IMAGE_TOKENS)
                    if key not in self._embeds or k >= self._embeds[key].shape[0]:
                        raise ValueError(
                            f"token id {t} is outside the vocabulary ({self.vocab_size}) and names no "
                            f"stored image (ImageStore.add gives an image's ids)"
                        )

    def resolve(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """token_ids (B, T) -> (the same with every image token id made the placeholder id, their embedding
        rows (n, d) in row-major order, or None when there is none)."""
        mask = token_ids >= self.vocab_size
        if not bool(mask.any()):
            return token_ids, None
        offsets = (token_ids[mask] - self.vocab_size).tolist()
        rows = []
        with self._lock:
            for offset in offsets:
                key, k = divmod(offset, MAX_IMAGE_TOKENS)
                embeds = self._embeds.get(key)
                if embeds is None or k >= embeds.shape[0]:
                    raise ValueError(
                        f"image token id {self.vocab_size + offset} names no stored image: it was "
                        f"dropped (more than {self.capacity} newer images) or never added"
                    )
                rows.append(embeds[k])
        return token_ids.masked_fill(mask, self.placeholder_id), torch.stack(rows)
