"""k3: an open, runnable implementation of the Kimi K3 architecture.

`from k3 import LLM, SamplingParams, K3Config, K3Model` works; each name is imported on first use, so
`import k3` alone (the CLI's --version, a config tool) does not load torch or the engine.
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "K3Cache": "k3.model",
    "K3Config": "k3.config",
    "K3Model": "k3.model",
    "generate": "k3.model",
    "LLM": "k3.serve.llm",
    "SamplingParams": "k3.serve.sampling",
}
__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'k3' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
