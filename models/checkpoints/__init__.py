"""Checkpoint readers (Hugging Face, Ferry, GGUF): each yields a Checkpoint that models/loading.py builds the
model from."""
