"""Serving: one paged memory pool, prefix cache, scheduler and engine (SPEC §3)."""
