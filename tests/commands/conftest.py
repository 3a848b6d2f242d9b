"""Fixtures the command tests share."""

from __future__ import annotations

import pytest
from llmc_test_support import two_shard_dir


@pytest.fixture
def data(tmp_path):
    """A data folder of one val and one train shard (llmc_test_support.two_shard_dir)."""
    return two_shard_dir(tmp_path)
