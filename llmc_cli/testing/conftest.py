"""Loads the kit's fixtures and hooks when it runs as `pytest --pyargs llmc_cli.testing`."""

import pytest

pytest.register_assert_rewrite("llmc_cli.testing.helpers")

from llmc_cli.testing.plugin import *  # noqa: E402,F401,F403
