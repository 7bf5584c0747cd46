"""k3: an open, runnable implementation of the Kimi K3 architecture."""

__version__ = "0.1.0"
