"""MLA's decoding attention over the page pool on k3's C++ CPU library (csrc/mla_decode_cpu.cpp,
`k3_cpu::mla_paged_decode`): what GatedMLA.attend runs for one new token per sequence when its cache is the
serving pool's and the library loads (k3.ops.cpu_library). GatedMLA.absorbed over the gathered latents is the
reference and the fallback."""

import torch

from k3.ops import cpu_library

DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def usable(q: torch.Tensor, latents: torch.Tensor) -> bool:
    """Whether the kernel runs on queries like q over this pool view: CPU, one dtype (fp32, fp64, or bf16 with
    fp32 arithmetic)."""
    if q.device.type != "cpu" or q.dtype not in DTYPES or latents.dtype != q.dtype:
        return False
    return cpu_library.load()


def paged_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv: torch.Tensor,
    latents: torch.Tensor,
    layer: int,
    tables: torch.Tensor,
    past: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_nope (B, H, nope), q_pe (B, H, rope): one query per sequence; c_kv (B, rank), k_pe (B, rope): its new
    latent, written into slot past_b of its pages (tables (B, W)) of MLA layer `layer` in the pool's latents
    (pages, P, n_mla, rank + rope); w_kv (H·(nope + v), rank) kv_b_proj's weight -> o (B, H, v), attention over
    the sequence's past_b + 1 latents."""
    return torch.ops.k3_cpu.mla_paged_decode(
        q_nope,
        q_pe,
        c_kv,
        k_pe,
        w_kv.detach().contiguous(),
        latents,
        layer,
        tables.contiguous(),
        past.contiguous(),
        float(scale),
    )
