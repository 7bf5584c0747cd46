"""Training data beyond the plain corpus: domains of the embedded corpus and synthetic tasks."""
