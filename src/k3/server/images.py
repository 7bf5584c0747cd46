"""OpenAI image content parts in chat messages: `{"type": "image_url", "image_url": {"url": "data:image/png;
base64,..."}}`, for a vision model.

Only base64 data URLs are taken (the server fetches nothing), at most MAX_IMAGES per request, each within
the body limit (`--max-body-bytes`) and k3.data.image_input's checks; every refusal is a 400 naming the
part. The chat renderer knows text only, so each image part is first replaced by a text part holding a
per-request sentinel that no user text can contain (a random nonce); after rendering, the sentinel's
segment is swapped for the image's span: media begin, the image's token ids from the engine's ImageStore
(content-keyed, so the prefix cache reuses an image it has seen), media end.
"""

import base64
import binascii
import re
import secrets

from k3.server.errors import APIError

MAX_IMAGES = 8  # image parts in one request
_DATA_URL = re.compile(r"data:(?P<mime>image/[A-Za-z0-9.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.S)


def decode_data_url(url: str, param: str) -> bytes:
    m = _DATA_URL.fullmatch(url)
    if m is None:
        what = "an http(s) URL: k3 serve fetches nothing" if url.startswith(("http:", "https:")) else "not one"
        raise APIError(
            400, f"{param}: an image must be a base64 data URL (data:image/png;base64,...); this is {what}", param=param
        )
    try:
        return base64.b64decode(m["data"], validate=True)
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"{param}: the data URL's base64 does not decode ({e})", param=param) from None


def take_images(messages: list[dict]) -> tuple[list[dict], list[tuple[str, bytes]], str]:
    """(messages with each image part replaced by a sentinel text part, [(param, image bytes)], the sentinel
    prefix); no images: the messages unchanged and an empty list."""
    nonce = secrets.token_hex(8)
    images: list[tuple[str, bytes]] = []
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list) or not any(p.get("type") == "image_url" for p in content):
            out.append(m)
            continue
        if m.get("role") != "user":
            raise APIError(
                400, f"messages[{i}]: images go in user messages, not {m.get('role')}", param=f"messages[{i}].content"
            )
        parts = []
        for j, part in enumerate(content):
            if part.get("type") != "image_url":
                parts.append(part)
                continue
            param = f"messages[{i}].content[{j}].image_url.url"
            if len(images) == MAX_IMAGES:
                raise APIError(400, f"{param}: more than {MAX_IMAGES} images in one request", param=param)
            images.append((param, decode_data_url(part["image_url"]["url"], param)))
            parts.append({"type": "text", "text": f"\ue000{nonce}:{len(images) - 1}\ue000"})
        out.append({**m, "content": parts})
    return out, images, f"\ue000{nonce}:"


def image_spans(store, tokenizer, images: list[tuple[str, bytes]]) -> list[list[int]]:
    """Each image's span (media begin, its token ids from the engine's ImageStore, media end); a bad image is
    a 400 naming its part. Runs the vision tower: call it off the event loop."""
    from k3.data.media import media_token_ids

    try:
        begin, _, end = media_token_ids(tokenizer)
    except ValueError as e:
        raise APIError(400, str(e), param=images[0][0]) from None
    spans = []
    for param, data in images:
        try:
            spans.append([begin, *store.add_encoded(data), end])
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
    return spans


def splice_images(chat, segments, spans: list[list[int]], sentinel: str) -> list[int]:
    """The rendered chat's ids with the i-th sentinel segment replaced by spans[i]; structural segments by
    their ids, text by the chat encoder's text encoding (as k3.chat.encode does)."""
    structural = {text: i for i, text in chat.token_ids.by_id().items()}
    ids: list[int] = []
    for s in segments:
        if s.structural:
            ids.append(structural[s.text])
        elif s.text.startswith(sentinel):
            ids.extend(spans[int(s.text[len(sentinel) : -1])])
        else:
            ids.extend(chat.encode_text(s.text))
    return ids
