"""The K3 model: one file per component, composed in model.py."""

from k3.model.cache import K3Cache
from k3.model.generate import generate
from k3.model.model import K3Model, K3Output

__all__ = ["K3Cache", "K3Model", "K3Output", "generate"]
