"""Training data: the shard loader and the tokenizers."""
