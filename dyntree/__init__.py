"""dyntree: lossless tree speculative decoding for vLLM, SGLang and Hugging Face transformers."""

__version__ = "0.1.0"
