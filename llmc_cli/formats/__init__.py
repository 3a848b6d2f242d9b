"""File formats, each read and written in one place: llm.c model .bin, safetensors, Hugging Face directories,
run directories and their lock, run logs; every write goes through a temporary name and a rename."""
