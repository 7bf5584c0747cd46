"""Speculative decoding (SPEC §3): the draft model, its training, verification and KDA state rollback."""
