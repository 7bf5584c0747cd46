"""MoonViT-V2: the native-resolution vision encoder, and the projector that merges 2x2 patches into one
token of the language model (SPEC §2.10). Parameter names are the release's (`vision_tower.*`,
`mm_projector.*`), so K3Model's state_dict carries them as they are.

Images keep their own size. Each image (3, H, W), H and W multiples of patch_size x merge, is cut into
patch_size² patches in row-major order; the patches of all images are packed into one sequence of N
patches with per-image boundaries `cu_seqlens` (B+1,), as varlen attention kernels take them. Position
information is 2-D and inside the encoder, twice:

    x      = conv(patch) + bilinear(pos_emb.weight (H0, W0, D) -> (h, w, D))[row, col]
    q, k   = rope2d(q, row, col), rope2d(k, row, col)     half the rotary pairs turn with the row, half
                                                           with the column (an image has no 1-D order)

then ViT blocks (pre-RMSNorm, attention within each image only, GELU-tanh MLP) and a final RMSNorm. The
projector groups each 2x2 neighbourhood of the (h, w) grid into one vector of 4·D, maps it with
Linear-GELU-Linear to the LM width and normalises it (`post_norm`): an image of h x w patches becomes
(h/2)·(w/2) LM tokens, in row-major order of the merged grid.

Legend: N patches of all images packed, B images, D tower width, Hh heads, Dh head dim.
"""

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import VisionConfig
from k3.model.norm import RMSNorm

NORM_EPS = 1e-5  # the tower's RMSNorms; the release's config names only the projector's eps
ROPE_THETA = 10000.0


def image_grid(shape: tuple[int, ...], config: VisionConfig) -> tuple[int, int]:
    """(h, w) patches of an image tensor (3, H, W); a ValueError when it cannot be cut into whole merged
    patches (the image loader resizes to fit: k3.data.image_input)."""
    p, (mh, mw) = config.patch_size, config.merge_kernel_size
    if len(shape) != 3 or shape[0] != 3:
        raise ValueError(f"an image tensor is (3, H, W) RGB, got shape {tuple(shape)}")
    _, H, W = shape
    if H == 0 or W == 0 or H % (p * mh) or W % (p * mw):
        raise ValueError(
            f"image of {H}x{W} pixels: height and width must be positive multiples of "
            f"{p * mh} x {p * mw} (patch {p}, merge {mh}x{mw})"
        )
    return H // p, W // p


def image_tokens(shape: tuple[int, ...], config: VisionConfig) -> int:
    """How many LM tokens (placeholders) an image tensor (3, H, W) becomes."""
    h, w = image_grid(shape, config)
    return (h // config.merge_kernel_size[0]) * (w // config.merge_kernel_size[1])


def patchify(images: list[torch.Tensor], config: VisionConfig):
    """images [(3, H, W)] -> (patches (N, 3, p, p), grids [(h, w)], cu_seqlens (B+1,) int64)."""
    p = config.patch_size
    patches, grids = [], []
    for image in images:
        h, w = image_grid(tuple(image.shape), config)
        x = image.reshape(3, h, p, w, p).permute(1, 3, 0, 2, 4)  # (h, w, 3, p, p)
        patches.append(x.reshape(h * w, 3, p, p))
        grids.append((h, w))
    lengths = torch.tensor([h * w for h, w in grids])
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))
    return torch.cat(patches), grids, cu_seqlens


def grid_positions(grids: list[tuple[int, int]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (N,), cols (N,)) of every packed patch in its own image."""
    rows = [torch.arange(h, device=device).repeat_interleave(w) for h, w in grids]
    cols = [torch.arange(w, device=device).repeat(h) for h, w in grids]
    return torch.cat(rows), torch.cat(cols)


def rope2d_angles(
    rows: torch.Tensor, cols: torch.Tensor, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the (N, Dh/2) rotation angles, each (N, 1, Dh/2), computed once for every block: the first
    Dh/4 pairs turn with the row, the last Dh/4 with the column, each at frequencies theta^(-i/(Dh/4))."""
    quarter = head_dim // 4
    inv_freq = ROPE_THETA ** -(torch.arange(quarter, dtype=torch.float64, device=rows.device) / quarter)
    angles = torch.cat([rows[:, None].double() * inv_freq, cols[:, None].double() * inv_freq], dim=-1)
    angles = angles.to(dtype if dtype == torch.float64 else torch.float32)
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope2d(x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x (N, Hh, Dh) with each adjacent pair (x[2i], x[2i+1]) rotated by rope2d_angles' (cos, sin)."""
    xf = x.float() if x.dtype != torch.float64 else x
    pairs = xf.unflatten(-1, (-1, 2))  # (N, Hh, Dh/2, 2)
    cos, sin = rotation
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


def same_image_mask(cu_seqlens: torch.Tensor, device=None) -> torch.Tensor:
    """(N, N) bool: True where query and key patches belong to the same image (block diagonal)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    image = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths.to(device))
    return image[:, None] == image[None, :]


class PosEmb2D(nn.Module):
    """A learned (H0, W0, D) table, bilinearly resized to each image's patch grid."""

    def __init__(self, height: int, width: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, grids: list[tuple[int, int]]) -> torch.Tensor:
        """grids [(h, w)] -> (N, D), row-major per image, images in order."""
        table = self.weight.permute(2, 0, 1)[None]  # (1, D, H0, W0)
        out = []
        for h, w in grids:
            if (h, w) == tuple(self.weight.shape[:2]):
                grid = table
            else:
                grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=False)
            out.append(grid[0].flatten(1).T)  # (h*w, D)
        return torch.cat(out)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        p, d = config.patch_size, config.vt_hidden_size
        self.proj = nn.Conv2d(3, d, kernel_size=p, stride=p, bias=False)
        self.pos_emb = PosEmb2D(config.init_pos_emb_height, config.init_pos_emb_width, d)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """patches (N, 3, p, p) -> (N, D)."""
        return self.proj(patches).flatten(1) + self.pos_emb(grids).to(patches.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """x + attn(norm0(x)), then + mlp(norm1(x)); attention only among the patches of one image."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        d, q = config.vt_hidden_size, config.qkv_hidden_size
        self.heads, self.head_dim = config.vt_num_attention_heads, config.head_dim
        self.norm0 = RMSNorm(d, NORM_EPS)
        self.wqkv = nn.Linear(d, 3 * q, bias=False)
        self.wo = nn.Linear(q, d, bias=False)
        self.norm1 = RMSNorm(d, NORM_EPS)
        self.mlp = VisionMLP(d, config.vt_intermediate_size)

    def forward(self, x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """x (N, D), rotation (rope2d_angles' cos, sin), mask (N, N) bool -> (N, D)."""
        q, k, v = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.heads, self.head_dim)).unbind(1)  # (N, Hh, Dh)
        q, k = apply_rope2d(q, rotation), apply_rope2d(k, rotation)
        # one call over the packed sequence with a block-diagonal mask: what a varlen kernel computes from
        # cu_seqlens; (Hh, N, Dh) layout for SDPA
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        x = x + self.wo(o.transpose(0, 1).flatten(1))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(config.vt_hidden_size, NORM_EPS)

    def forward(self, x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, rotation, mask)
        return self.final_layernorm(x)


class VisionTower(nn.Module):
    """`vision_tower`: images [(3, H, W)] -> (features (N, D), grids [(h, w)])."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.encoder = VisionEncoder(config)

    def forward(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        dtype = self.patch_embed.proj.weight.dtype
        patches, grids, cu_seqlens = patchify([im.to(dtype) for im in images], self.config)
        rows, cols = grid_positions(grids, patches.device)
        rotation = rope2d_angles(rows, cols, self.config.head_dim, dtype)
        mask = same_image_mask(cu_seqlens, patches.device)
        return self.encoder(self.patch_embed(patches, grids), rotation, mask), grids


def merge_patches(features: torch.Tensor, grids: list[tuple[int, int]], kernel: tuple[int, int]) -> torch.Tensor:
    """(N, D) -> (N / (kh·kw), kh·kw·D): each kh x kw neighbourhood of an image's grid as one vector, in
    row-major order of the merged grid; within a group, the kh·kw patches in row-major order."""
    kh, kw = kernel
    out, start = [], 0
    for h, w in grids:
        x = features[start : start + h * w].reshape(h // kh, kh, w // kw, kw, -1)
        out.append(x.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), -1))
        start += h * w
    return torch.cat(out)


class PatchMergerProjector(nn.Module):
    """`mm_projector` (patchmergerv2): merged 2x2 patches (4·D) -> Linear -> GELU -> Linear -> RMSNorm, the
    LM's width."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.kernel = config.merge_kernel_size
        merged = config.mm_hidden_size * config.merged_patches
        self.proj = nn.Sequential(
            nn.Linear(merged, merged, bias=False), nn.GELU(), nn.Linear(merged, config.text_hidden_size, bias=False)
        )
        self.post_norm = RMSNorm(config.text_hidden_size, config.projector_ln_eps)

    def forward(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """features (N, D) -> (tokens, text_hidden_size)."""
        return self.post_norm(self.proj(merge_patches(features, grids, self.kernel)))


def place_image_tokens(
    x: torch.Tensor, input_ids: torch.Tensor, image_embeds: torch.Tensor, placeholder_id: int
) -> torch.Tensor:
    """x (B, T, d) with the rows of image_embeds (n, d) put, in order, at the n positions where input_ids
    (B, T) holds the placeholder token (row-major over the batch)."""
    mask = input_ids == placeholder_id
    n = int(mask.sum())
    if n != image_embeds.shape[0]:
        raise ValueError(
            f"{n} image placeholder tokens (id {placeholder_id}) in the input, but "
            f"{image_embeds.shape[0]} image embeddings: each image needs as many placeholders as it has "
            f"tokens"
        )
    return x.masked_scatter(mask[..., None], image_embeds.to(x.dtype))
