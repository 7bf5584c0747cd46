"""Interactive figures served by k3 (`k3 demo`), computed with k3's own code: the routing demo (docs/routing.md)."""
