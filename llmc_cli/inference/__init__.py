"""Inference: sampling tokens, and incremental decoding over a key/value cache."""
