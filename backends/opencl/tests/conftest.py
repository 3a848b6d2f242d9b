"""This backend's own tests take the conformance kit's fixtures (`backend`, `cpu`, `rng`, ...) and markers."""

from llmc_cli.testing.plugin import *  # noqa: F401,F403
