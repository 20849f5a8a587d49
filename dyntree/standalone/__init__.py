"""Standalone speculative engine over Hugging Face transformers causal LMs."""
