"""Multi-teacher on-policy distillation (SPEC §4): specialist teachers by domain and reasoning effort merged
into one student trained on per-token reverse KL on its own samples (`k3 distill`, docs/distillation.md)."""
