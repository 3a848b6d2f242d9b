"""`python -m llmc_cli ...` is the `llmc` command (the launcher starts ranks this way)."""
from .entry import run

run()
