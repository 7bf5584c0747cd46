"""`k3 generate --image IMG ...`: a prompt about one or more images, for a vision model.

Each image is checked (k3.data.image_input) before the weights are read, then resized, encoded once by
the engine's ImageStore (k3.serve.images) and placed before the prompt as a media span (k3.data.media):
the request is token ids, served by the engine like any other (streaming, -n, stop strings, the prefix
cache keyed by the image's content).
"""


def load_images(paths: list[str]) -> list:
    """Checked RGB images (an ImageError, a ValueError, names the file and what is wrong)."""
    from k3.data.image_input import load_image

    return [load_image(path) for path in paths]


def image_prompt(llm, pictures: list, prompt: str) -> list[int]:
    """[media begin, image token ids, media end] per image, then the prompt's ids."""
    from k3.data.image_input import image_to_tensor
    from k3.data.media import media_token_ids

    store = llm.engine.images
    if store is None:
        raise ValueError("--image needs a vision model; this one is text-only (its config has no vision_config)")
    begin, _, end = media_token_ids(llm.tokenizer)
    vision = llm.engine.model.config.vision_config
    ids = [i for p in pictures for i in (begin, *store.add(image_to_tensor(p, vision)), end)]
    return ids + llm.tokenizer.encode(prompt)
