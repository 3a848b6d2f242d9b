"""The tokenize workflow: reading corpora, downloading them, and turning documents into llm.c shards."""
