"""llmc: LLM training from scratch, llm.c style, with pluggable backends."""
__version__ = "0.1.0"
