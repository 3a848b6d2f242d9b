"""Axis ticks of `llmc plot` read as counts (400k, not 400000)."""

import pytest

from llmc_cli.charts import short_count


@pytest.mark.parametrize("value, text", [
    (0, "0"), (12, "12"), (999, "999"), (1000, "1k"), (400_000, "400k"), (1_500_000, "1.5M"),
    (2_000_000_000, "2B"), (-3000, "-3k"), (0.5, "0.5"),
])
def test_short_count_reads_as_people_count(value, text):
    assert short_count(value) == text
