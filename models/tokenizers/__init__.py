"""Tokenizers and chat templates: the backends (tokenizer.py), GGUF metadata (gguf.py), picking one (load.py)."""
