"""`first_derivative_only`: the guard on k3's hand-written backwards.

Each of k3's `torch.autograd.Function`s computes its first derivative by hand, with in-place ops and saved
statistics (such as 1/rms) treated as constants, so differentiating that backward again would give wrong
values. torch's `once_differentiable` does not always stop it: it hangs its error on detached copies of the
gradients, which `torch.autograd.grad(..., inputs=x)` prunes, so a gradient penalty would silently miss
these terms. This raises whenever a second derivative is being built (grad mode is on inside a backward only
under create_graph=True).
"""

import functools
from collections.abc import Callable

import torch


def first_derivative_only(backward: Callable) -> Callable:
    """Decorate a Function's `backward`: it raises under create_graph=True instead of returning gradients."""

    @functools.wraps(backward)
    def guarded(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(ctx).__name__.removesuffix('Backward')}: k3 computes this first derivative by hand; a second "
                "derivative (create_graph=True, double backward) is not supported"
            )
        return backward(ctx, *grads)

    return guarded
