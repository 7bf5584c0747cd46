"""Training data beyond the plain corpus: domains of the embedded corpus and synthetic tasks; generated
images with questions and answers, images checked and prepared for the vision tower, and the media tokens
that place them in a token sequence (images.py, image_input.py, media.py; docs/vision.md)."""
