"""The commands layer: the only place that imports click or prints for the user. Each command parses its
options, calls the library below, and turns its errors into one line (`console.fail`)."""

from llmc_cli.commands.main import main

__all__ = ["main"]
