"""The kernel conformance kit (llmc_cli.testing.test_kernels) over every installed backend, as part of llmc's
own suite; a third party runs the same cases with `pytest --pyargs llmc_cli.testing`."""

import pytest

pytest.importorskip("torch", reason="PyTorch is the test oracle: pip install torch==2.13.0")

from llmc_cli.testing.test_kernels import *  # noqa: E402,F401,F403
