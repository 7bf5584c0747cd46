"""The vision encoder (k3.model.vision): packing, 2-D positions, the 2x2 merge, the release's names and
counts, and image tokens in the language model (cache consistency included)."""

import dataclasses

import pytest
import torch

from k3.config import ConfigError, K3Config, VisionConfig
from k3.model import K3Cache, K3Model
from k3.model.params import param_report
from k3.model.vision import (
    PatchMergerProjector,
    VisionTower,
    apply_rope2d,
    image_tokens,
    merge_patches,
    rope2d_angles,
)

TINY_VISION = VisionConfig(
    vt_hidden_size=32,
    vt_num_hidden_layers=2,
    vt_num_attention_heads=2,
    qkv_hidden_size=32,
    vt_intermediate_size=64,
    init_pos_emb_height=4,
    init_pos_emb_width=4,
    mm_hidden_size=32,
    text_hidden_size=64,
    media_placeholder_token_id=7,
)


def tiny_vl() -> K3Config:
    return K3Config.from_preset("tiny", vision_config=TINY_VISION)


def images(*sizes, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=gen, dtype=dtype) for h, w in sizes]


def test_packing_mixed_sizes_equals_encoding_each_alone():
    torch.manual_seed(0)
    tower, proj = VisionTower(TINY_VISION).double(), PatchMergerProjector(TINY_VISION).double()
    # 56x28 is off the 4x4 table (interpolated), 56x56 on it (the table as is), 28x84 wide
    ims = images((56, 28), (56, 56), (28, 84), (28, 28))
    with torch.no_grad():
        packed = proj(*tower(ims))
        alone = [proj(*tower([im])) for im in ims]
    assert [a.shape[0] for a in alone] == [image_tokens(im.shape, TINY_VISION) for im in ims] == [2, 4, 3, 1]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-12)
    # and the images do see each other's absence: changing one image changes only its own tokens
    other = [ims[0], ims[1] + 1.0, ims[2], ims[3]]
    with torch.no_grad():
        changed = proj(*tower(other))
    assert torch.equal(changed[:2], packed[:2]) and torch.equal(changed[6:], packed[6:])
    assert not torch.allclose(changed[2:6], packed[2:6])


def test_rope2d_scores_depend_only_on_the_offset():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 16, dtype=torch.float64), torch.randn(1, 2, 16, dtype=torch.float64)

    def score(qpos, kpos):
        qa = rope2d_angles(torch.tensor([qpos[0]]), torch.tensor([qpos[1]]), 16, torch.float64)
        ka = rope2d_angles(torch.tensor([kpos[0]]), torch.tensor([kpos[1]]), 16, torch.float64)
        return (apply_rope2d(q, qa) * apply_rope2d(k, ka)).sum(-1)

    torch.testing.assert_close(score((3, 5), (1, 2)), score((10, 7), (8, 4)), rtol=0, atol=1e-12)
    assert not torch.allclose(score((3, 5), (1, 2)), score((3, 5), (2, 1)))  # rows and columns are told apart


def test_merge_groups_two_by_two_neighbourhoods_in_row_major_order():
    h, w, d = 4, 6, 1
    features = torch.arange(h * w, dtype=torch.float64).view(h * w, d)  # patch (r, c) holds r*w + c
    merged = merge_patches(features, [(h, w)], (2, 2))
    assert merged.shape == (6, 4)
    assert merged[0].tolist() == [0, 1, 6, 7] and merged[1].tolist() == [2, 3, 8, 9]
    assert merged[3].tolist() == [12, 13, 18, 19]  # second merged row


def test_bad_image_shapes_are_value_errors():
    tower = VisionTower(TINY_VISION)
    with pytest.raises(ValueError, match="multiples of 28 x 28"):
        tower(images((30, 28), dtype=torch.float32))
    with pytest.raises(ValueError, match=r"\(3, H, W\)"):
        tower([torch.zeros(1, 28, 28)])
    with pytest.raises(ValueError, match="positive multiples"):
        tower([torch.zeros(3, 0, 28)])


RELEASED_VISION_SHAPES = {  # the released checkpoint's vision tensors (bf16), block 0 standing for all 27
    "vision_tower.encoder.blocks.0.wqkv.weight": (4608, 1024),
    "vision_tower.encoder.blocks.0.wo.weight": (1024, 1536),
    "vision_tower.encoder.blocks.0.mlp.fc0.weight": (4096, 1024),
    "vision_tower.encoder.blocks.0.mlp.fc1.weight": (1024, 4096),
    "vision_tower.encoder.blocks.0.norm0.weight": (1024,),
    "vision_tower.encoder.blocks.0.norm1.weight": (1024,),
    "vision_tower.encoder.final_layernorm.weight": (1024,),
    "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
    "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
    "mm_projector.post_norm.weight": (7168,),
    "mm_projector.proj.0.weight": (4096, 4096),
    "mm_projector.proj.2.weight": (7168, 4096),
}


def test_release_names_shapes_and_tower_count():
    config = K3Config.from_preset("k3")
    with torch.device("meta"):
        tower, proj = VisionTower(config.vision_config), PatchMergerProjector(config.vision_config)
    shapes = {f"vision_tower.{n}": tuple(p.shape) for n, p in tower.state_dict().items()}
    shapes |= {f"mm_projector.{n}": tuple(p.shape) for n, p in proj.state_dict().items()}
    blocks = {n for n in shapes if ".blocks." in n}
    assert {n.split(".")[3] for n in blocks} == {str(i) for i in range(27)}
    assert {n: s for n, s in shapes.items() if ".blocks." not in n or ".blocks.0." in n} == RELEASED_VISION_SHAPES
    # the tower by hand: 27 blocks of wqkv, wo, fc0, fc1 and two norms, the final norm, the position table and
    # the patch projection; 401,214,464 = SPEC §1's "401M" (the projector, 46.1M, is not part of it)
    block = 4608 * 1024 + 1024 * 1536 + 2 * 4096 * 1024 + 2 * 1024
    tower_count = 27 * block + 1024 + 64 * 64 * 1024 + 1024 * 3 * 14 * 14
    assert tower_count == sum(p.numel() for p in tower.parameters()) == 401_214_464
    assert sum(p.numel() for p in proj.parameters()) == 4096 * 4096 + 7168 * 4096 + 7168
    assert abs(tower_count - 401e6) / 401e6 < 0.001


def test_params_counts_the_tower_per_image_not_per_token():
    v, c = TINY_VISION, tiny_vl()
    report, text_only = param_report(c, context=0), param_report(K3Config.from_preset("tiny"), context=0)
    block = v.vt_hidden_size * 3 * v.qkv_hidden_size + v.qkv_hidden_size * v.vt_hidden_size
    block += 2 * v.vt_hidden_size * v.vt_intermediate_size + 2 * v.vt_hidden_size
    tower = v.vt_num_hidden_layers * block + v.vt_hidden_size * (1 + 4 * 4 + 3 * 14 * 14)
    merged = 4 * v.vt_hidden_size
    assert report["components"]["vision_tower"] == {"total": tower, "active": 0}
    assert report["components"]["mm_projector"] == {"total": merged * merged + merged * 64 + 64, "active": 0}
    assert report["total"] == text_only["total"] + tower + merged * merged + merged * 64 + 64
    assert report["active"] == text_only["active"] and report["flops_per_token"] == text_only["flops_per_token"]


def test_vision_config_round_trip_and_checks():
    c = K3Config.from_preset("small-vl")
    doc = c.to_hf()
    assert K3Config.from_hf(doc) == c and K3Config.from_hf(doc).to_hf() == doc
    doc["vision_config"]["norm_type"] = "layernorm"
    with pytest.raises(ConfigError, match=r"vision_config\.norm_type = 'layernorm'"):
        K3Config.from_hf(doc)
    with pytest.raises(ConfigError, match="text_hidden_size = 7168"):
        K3Config.from_preset("tiny", vision_config=VisionConfig())
    with pytest.raises(ConfigError, match="2-D rotary"):
        dataclasses.replace(TINY_VISION, qkv_hidden_size=36, vt_num_attention_heads=6)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        K3Config.from_preset("tiny", vision_config=dataclasses.replace(TINY_VISION, media_placeholder_token_id=512))


def _prompt(n_image_tokens: int, text_before=(1, 2), text_after=(3, 4, 5)) -> torch.Tensor:
    ph = TINY_VISION.media_placeholder_token_id
    return torch.tensor([[*text_before, *([ph] * n_image_tokens), *text_after]])


def test_image_tokens_replace_placeholders_and_cached_decode_equals_uncached():
    torch.manual_seed(0)
    model = K3Model(tiny_vl()).double().eval()
    ims = images((56, 28), (28, 56), seed=1)
    with torch.no_grad():
        embeds = model.encode_images(ims)  # 2 + 2 tokens
        ids = torch.cat([_prompt(2), _prompt(2, (8,), (9, 10))], dim=1)
        full = model(ids, image_embeds=embeds).logits
        without = model(ids).logits
        assert not torch.allclose(full[:, 3:], without[:, 3:])  # the image is seen after its tokens
        torch.testing.assert_close(full[:, :2], without[:, :2], rtol=0, atol=1e-12)  # and not before (causal)
        # prefill in chunks that cut through the image tokens, each chunk given its own rows, then decode
        cache, pieces, row = K3Cache.empty(model.config), [], 0
        ph = TINY_VISION.media_placeholder_token_id
        for start, end in ((0, 3), (3, 9), (9, ids.shape[1] - 2)):
            chunk = ids[:, start:end]
            n = int((chunk == ph).sum())
            pieces.append(model(chunk, cache, image_embeds=embeds[row : row + n]).logits)
            row += n
        for t in range(ids.shape[1] - 2, ids.shape[1]):
            pieces.append(model(ids[:, t : t + 1], cache).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-10)


def test_placeholder_count_mismatch_and_text_only_model_are_errors():
    model = K3Model(tiny_vl())
    embeds = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="2 image placeholder tokens"):
        model(_prompt(2), image_embeds=embeds)
    with pytest.raises(ValueError, match="no vision tower"):
        K3Model(K3Config.from_preset("tiny")).encode_images(images((28, 28), dtype=torch.float32))


def test_the_tower_trains_through_the_language_model_loss():
    torch.manual_seed(0)
    model = K3Model(tiny_vl())
    ids = _prompt(2)
    out = model(ids, labels=ids, image_embeds=model.encode_images(images((56, 28), dtype=torch.float32)))
    out.loss.backward()
    for name in (
        "vision_tower.patch_embed.proj.weight",
        "vision_tower.patch_embed.pos_emb.weight",
        "vision_tower.encoder.blocks.0.wqkv.weight",
        "mm_projector.proj.0.weight",
    ):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
