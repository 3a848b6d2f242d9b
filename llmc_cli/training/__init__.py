"""The training loop and what keeps a long run alive and honest."""
