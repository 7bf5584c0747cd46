"""k3: an open, runnable implementation of the Kimi K3 architecture."""

from k3.config import K3Config
from k3.model import K3Cache, K3Model, generate

__version__ = "0.1.0"
__all__ = ["K3Cache", "K3Config", "K3Model", "__version__", "generate"]
