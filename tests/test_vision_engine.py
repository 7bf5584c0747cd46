"""Image requests through the serving engine: prefix caching keyed by image content, outputs equal to the
uncached model (k3.serve.images)."""

import pytest
import torch

from k3 import generate
from k3.config import VisionConfig
from k3.data.media import MEDIA_TOKENS, media_token_ids
from k3.formats.tokenizer import K3Tokenizer, byte_tokenizer
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def tok() -> K3Tokenizer:
    t = byte_tokenizer()
    t.tok.add_special_tokens(MEDIA_TOKENS)
    return t


@pytest.fixture(scope="module")
def model(tok):
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
        media_placeholder_token_id=media_token_ids(tok)[1],
    )
    return tiny_model(vocab_size=tok.vocab_size, vision_config=vision)


def image(seed: int) -> torch.Tensor:
    return torch.rand(3, 56, 84, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1


def prompt(eng: LLMEngine, tok, pixels: torch.Tensor) -> list[int]:
    begin, _, end = media_token_ids(tok)
    before = tok.encode("A long shared system prompt that fills a few pages of the cache. Look: ")
    return [*before, begin, *eng.images.add(pixels), end, *tok.encode(" How many shapes are there?\n")]


def reference(model, tok, pixels: torch.Tensor, n: int) -> list[int]:
    """Greedy tokens of the plain model with its own cache: no engine, no pages, no prefix cache."""
    begin, placeholder, end = media_token_ids(tok)
    embeds = model.encode_images([pixels])
    ids = [
        *tok.encode("A long shared system prompt that fills a few pages of the cache. Look: "),
        begin,
        *[placeholder] * embeds.shape[0],
        end,
        *tok.encode(" How many shapes are there?\n"),
    ]
    out = generate(model, torch.tensor([ids]), n, temperature=0, image_embeds=embeds)
    return out[0, len(ids) :].tolist()


def run(eng: LLMEngine, ids: list[int], n: int):
    rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    tokens, cached = [], None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
    return tokens, cached


def test_image_requests_hit_the_prefix_cache_by_content_and_equal_the_uncached_model(model, tok):
    eng = LLMEngine(model, tok, EngineConfig(num_pages=400, enable_prefix_caching=True))
    x, y = image(1), image(2)
    ids_x = prompt(eng, tok, x)
    image_start = ids_x.index(media_token_ids(tok)[0]) + 1
    first, cached_first = run(eng, ids_x, 6)
    assert first == reference(model, tok, x, 6) and cached_first == 0
    again, cached_again = run(eng, prompt(eng, tok, x), 6)  # the same image: its tokens come from the cache
    assert again == first and cached_again > image_start + 6
    other_ids = prompt(eng, tok, y)
    assert other_ids[image_start] != ids_x[image_start]  # another image, other ids
    other, cached_other = run(eng, other_ids, 6)  # the shared text is reused, the image is not
    assert other == reference(model, tok, y, 6) and 0 < cached_other <= image_start


def test_image_token_ids_are_refused_by_a_text_model(tok):
    text_model = tiny_model(vocab_size=tok.vocab_size)
    eng = LLMEngine(text_model, tok, EngineConfig(num_pages=200))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, 2, tok.vocab_size + 5], SamplingParams(max_tokens=2))
    assert eng.images is None


def test_unknown_image_token_ids_are_refused_at_admission(model, tok):
    eng = LLMEngine(model, tok, EngineConfig(num_pages=200))
    ids = eng.images.add(image(3))
    with pytest.raises(ValueError, match="names no stored image"):
        eng.add_request([1, 2, ids[0] + 1000], SamplingParams(max_tokens=2))
    assert not eng.has_unfinished()


def test_the_store_keeps_the_newest_images_and_says_when_one_was_dropped(model):
    from k3.serve.images import ImageStore

    store = ImageStore(model, capacity=2)
    first = store.add(image(10))
    assert store.add(image(10)) == first  # the same content: the same ids, encoded once
    store.add(image(11))
    store.add(image(12))  # the third image drops the oldest
    with pytest.raises(ValueError, match="dropped"):
        store.resolve(torch.tensor([[1, first[0]]]))
    ids, embeds = store.resolve(torch.tensor([[1, *store.add(image(12))[:2]]]))
    assert ids.tolist() == [[1, store.placeholder_id, store.placeholder_id]] and embeds.shape == (2, 64)
