"""Paged attention for TPUs: the Mosaic ragged paged-attention kernel."""
