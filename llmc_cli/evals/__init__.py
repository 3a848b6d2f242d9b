"""Evaluations of a trained model: mean loss over shards, HellaSwag."""
