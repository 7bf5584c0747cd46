"""k3 serve with a vision model: OpenAI image content parts (base64 data URLs) in chat messages, through the
real engine; bad images are 400s that name the part."""

import base64
import io

import httpx
import pytest
import torch
from PIL import Image

from k3.config import VisionConfig
from k3.data.images import example
from k3.data.media import MEDIA_TOKENS, media_token_ids
from k3.formats.tokenizer import byte_tokenizer
from k3.serve.async_engine import AsyncEngine
from k3.serve.engine import EngineConfig, LLMEngine
from k3.server import ServerLimits
from k3.server.app import create_app
from server_helpers import ServerThread
from tiny_models import tiny_model

TOK = byte_tokenizer()
TOK.tok.add_special_tokens(MEDIA_TOKENS)


def data_url(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def served():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        vision = VisionConfig(
            vt_hidden_size=32,
            vt_num_hidden_layers=2,
            vt_num_attention_heads=2,
            qkv_hidden_size=32,
            vt_intermediate_size=64,
            init_pos_emb_height=4,
            init_pos_emb_width=4,
            mm_hidden_size=32,
            text_hidden_size=64,
            media_placeholder_token_id=media_token_ids(TOK)[1],
        )
        model = tiny_model(vocab_size=TOK.vocab_size, vision_config=vision).float()
        engine = AsyncEngine(LLMEngine(model, TOK, EngineConfig(num_pages=2000)))
        engine.start()
        app = create_app(engine, "tiny-vl", ServerLimits(max_model_len=1024, max_tokens=16, max_body_bytes=4 << 20))
        with ServerThread(app) as url:
            yield url, engine
        engine.shutdown(drain_timeout=0)
    finally:
        torch.set_num_threads(threads)


def chat(url: str, content, **extra) -> httpx.Response:
    body = {
        "model": "tiny-vl",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_image_parts_are_answered_and_their_tokens_cached_by_content(served):
    url, _ = served
    image = example("eval", 0).image  # 2x2 .. 4x4 tokens after the merge
    content = [
        {"type": "text", "text": "How many shapes are there?"},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
    ]
    first = chat(url, content)
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    text_only = chat(url, [{"type": "text", "text": "How many shapes are there?"}]).json()["usage"]
    n_image = (image.width // 28) * (image.height // 28)
    assert usage["prompt_tokens"] == text_only["prompt_tokens"] + n_image + 2  # + media begin and end
    again = chat(url, content)
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = [content[0], {"type": "image_url", "image_url": {"url": data_url(example("eval", 1).image)}}]
    assert chat(url, other).status_code == 200


@pytest.mark.parametrize(
    "url_value, message",
    [
        ("https://example.com/cat.png", "k3 serve fetches nothing"),
        ("data:image/png;base64,@@@", "does not decode"),
        ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode(), "truncated or corrupt"),
    ],
)
def test_bad_image_parts_are_400_naming_the_part(served, url_value, message):
    url, _ = served
    r = chat(url, [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url_value}}])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == "messages[0].content[1].image_url.url"


def test_image_limits_are_400s(served):
    url, _ = served
    deep = data_url(Image.new("I;16", (28, 28)))
    r = chat(url, [{"type": "image_url", "image_url": {"url": deep}}])
    assert r.status_code == 400 and "pixel mode 'I;16'" in r.json()["error"]["message"]
    small = {"type": "image_url", "image_url": {"url": data_url(Image.new("RGB", (28, 28)))}}
    r = chat(url, [small] * 9)
    assert r.status_code == 400 and "more than 8 images" in r.json()["error"]["message"]
    body = {
        "model": "tiny-vl",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": [small]}, {"role": "user", "content": "hi"}],
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "images go in user messages" in r.json()["error"]["message"]
