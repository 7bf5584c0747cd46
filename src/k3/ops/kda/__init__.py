"""Kimi Delta Attention (SPEC §2.1), with fla.ops.kda's layouts and argument names.

- naive.py            the per-timestep reference (the spec in code)
- chunk.py            chunkwise-parallel form for prefill and training
- chunk_bwd.py        its hand-written backward
- fused_recurrent.py  token-by-token form for decoding, in place on a caller's state
- gate.py             the bounded log-decay gate and the q/k L2 norm
- backend.py          fla's Triton kernels on CUDA, PyTorch everywhere
"""

from k3.ops.kda.chunk import chunk_kda
from k3.ops.kda.fused_recurrent import fused_recurrent_kda
from k3.ops.kda.gate import kda_gate, l2norm
from k3.ops.kda.naive import naive_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda", "kda_gate", "l2norm", "naive_recurrent_kda"]
