"""How an image sits in a token sequence: a media start token, one placeholder per image token, a media
end token (SPEC §2.10). The language model replaces each placeholder's embedding with the projector's
output for that token (K3Model.forward(image_embeds=)); the start and end tokens are ordinary embeddings
that tell the model where an image begins and ends.

    <|media_begin|> <|kimi_image_placeholder|> x n <|media_end|> question ... answer

The placeholder is spelled as the release's `image_placeholder`; its id is the config's
`media_placeholder_token_id`. The three tokens are special added tokens, so no user text can forge them.
"""

from tokenizers import Tokenizer

MEDIA_BEGIN = "<|media_begin|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
MEDIA_END = "<|media_end|>"
MEDIA_TOKENS = [MEDIA_BEGIN, IMAGE_PLACEHOLDER, MEDIA_END]


def media_token_ids(tokenizer) -> tuple[int, int, int]:
    """(begin, placeholder, end) ids of a K3Tokenizer or tokenizers.Tokenizer; a ValueError naming what is
    missing when the tokenizer was not made for images."""
    raw = tokenizer if isinstance(tokenizer, Tokenizer) else tokenizer.tok
    added = raw.get_added_tokens_decoder()
    ids, missing = [], []
    for name in MEDIA_TOKENS:
        i = raw.token_to_id(name)
        if i is None or i not in added or not added[i].special:
            missing.append(name)
        ids.append(i)
    if missing:
        raise ValueError(
            f"this tokenizer has no image tokens ({', '.join(missing)} not registered as special "
            f"tokens): the model was not trained with images"
        )
    return ids[0], ids[1], ids[2]


def image_span(tokenizer, n_tokens: int) -> list[int]:
    """The ids that stand for one image of n_tokens LM tokens."""
    begin, placeholder, end = media_token_ids(tokenizer)
    return [begin, *([placeholder] * n_tokens), end]
