"""The engine's speculative decoding (docs/speculative.md): proposals from a draft after each step
(`proposer`), their verification against the big model's logits (`verify`) and the counters (`stats`).
The KDA states of proposal rows go back to the last accepted token in the pool's own state class
(k3.serve.kda_state). The draft model and its training are k3.spec, which imports nothing of serve."""
