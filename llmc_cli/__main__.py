"""`python -m llmc_cli ...` is the `llmc` command (the launcher starts ranks this way)."""
from llmc_cli.entry import run

run()
