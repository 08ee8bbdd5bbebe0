"""Prompt -> token ids at the router's edge: tokenizers (tiktoken-format BPE files, HF
``tokenizer.json``), HF-style chat templates rendered with Jinja2, and incremental
tokenization of multi-turn conversations keyed by message boundaries.

Nothing here does network I/O; files are read once when a model's processor is built.
"""
