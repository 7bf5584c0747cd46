"""Speculative decoding's draft (SPEC §3): the draft model, the big model's features it reads, its folder and
its training. The engine's side (proposals, verification, KDA rollback) is k3.serve's, which imports this
package; this package imports nothing of k3.serve."""
