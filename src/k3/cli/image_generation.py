"""`k3 generate --image IMG ...`: a prompt about one or more images, answered by a vision model.

Each image is checked and resized (k3.data.image_input), encoded by the model's tower and projector, and
placed before the prompt as a media span (k3.data.media); the continuation is sampled with the model's
own cache (k3.model.generate). The serving engine's image path is separate (docs/vision.md).
"""

import argparse
import sys

import torch

from k3.cli.common import USER_ERRORS, _device, _fail


def generate_with_images(args: argparse.Namespace, prompt: str) -> int:
    from k3.data.image_input import DEFAULT_MAX_TOKENS, image_to_tensor, load_image
    from k3.data.media import image_span
    from k3.hub import load_for_inference
    from k3.model.generate import generate
    from k3.model.vision import image_tokens

    try:
        if args.stream or args.n != 1 or args.top_k or args.stop:
            raise ValueError("--image answers one completion without --stream, -n, --top-k or --stop")
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens {args.max_tokens}: must be at least 1")
        pictures = [load_image(path) for path in args.image]  # a bad image is refused before the weights load
        model, tokenizer = load_for_inference(args.ckpt, device=_device(args.device))
        vision = model.config.vision_config
        if vision is None:
            raise ValueError(f"{args.ckpt} is a text-only model (no vision_config): it cannot take --image")
        tensors = [image_to_tensor(p, vision, DEFAULT_MAX_TOKENS) for p in pictures]
        ids = [i for t in tensors for i in image_span(tokenizer, image_tokens(tuple(t.shape), vision))]
        ids += tokenizer.encode(prompt)
        limit = model.config.max_position_embeddings
        if len(ids) + args.max_tokens > limit:
            raise ValueError(f"the images and prompt are {len(ids):,} tokens; with --max-tokens {args.max_tokens:,} "
                             f"they exceed the context of {limit:,}")  # fmt: skip
        device = next(model.parameters()).device
        with torch.no_grad():
            embeds = model.encode_images([t.to(device) for t in tensors])
            prompt_ids = torch.tensor([ids], device=device)
            out = generate(model, prompt_ids, args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, eos_token_id=tokenizer.eos_id, image_embeds=embeds)  # fmt: skip
        new = out[0, len(ids) :].tolist()
        if tokenizer.eos_id in new:
            new = new[: new.index(tokenizer.eos_id)]
        print(f"[{len(tensors)} image(s): {sum(image_tokens(tuple(t.shape), vision) for t in tensors)} tokens]",
              file=sys.stderr)  # fmt: skip
        print(prompt + tokenizer.decode(new))
    except USER_ERRORS as e:
        return _fail("generate", e)
    return 0
