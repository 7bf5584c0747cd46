"""Sequence-mixing and numeric kernels: each a plain reference beside its fast path."""
