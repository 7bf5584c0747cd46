"""fla's pure-PyTorch KDA references (fla/ops/kda/naive.py), loaded straight from the installed
package: importing fla.ops pulls in Triton, which a CPU-only machine may not have."""

import importlib.util
from pathlib import Path


def load_fla_naive():
    """The module fla.ops.kda.naive, or None when flash-linear-attention (or einops) is missing."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    if not path.exists() or importlib.util.find_spec("einops") is None:
        return None
    naive_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(naive_spec)
    naive_spec.loader.exec_module(module)
    return module
