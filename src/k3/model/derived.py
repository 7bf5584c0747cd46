"""Tensors derived from parameters (concatenated projections, folded vectors) kept across inference
calls instead of rebuilt on every one, and rebuilt as soon as a source changes.

A source changes by being written in place (an optimizer step, load_state_dict, `p.copy_`: its
version counter moves), replaced by another tensor (`module.weight = ...`), or moved or cast
(`.to()` gives it new storage): the key holds the sources themselves, their versions and storage.
Under autograd the tensor is built fresh on every call, so gradients reach the parameters.
"""

from collections.abc import Callable

import torch


class DerivedWeight:
    """build(*sources) -> tensor, cached while the sources are unchanged (see the module docstring)."""

    def __init__(self, build: Callable[..., torch.Tensor]):
        self.build = build
        self._sources: tuple[torch.Tensor, ...] = ()
        self._key: tuple = ()
        self._value: torch.Tensor | None = None

    def __call__(self, *sources: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.build(*sources)
        if torch.compiler.is_compiling():
            # a compiled graph takes the kept tensor as it is (a graph cannot read versions or storage); one
            # not built yet is built in the graph
            return self._value if self._value is not None else self.build(*sources)
        key = tuple((t._version, t.data_ptr(), t.dtype, t.device) for t in sources)
        fresh = self._value is not None and len(sources) == len(self._sources) and key == self._key
        if not (fresh and all(a is b for a, b in zip(sources, self._sources, strict=True))):
            self._value = self.build(*sources)
            self._sources, self._key = sources, key
        return self._value
