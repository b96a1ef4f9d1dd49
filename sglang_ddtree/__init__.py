"""sglang-ddtree: DDTree tree speculative decoding as an SGLang plugin."""

__version__ = "0.1.0"
