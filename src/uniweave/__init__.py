"""uniweave: post-training of unified multimodal autoregressive models."""

__version__ = "0.1.0"
