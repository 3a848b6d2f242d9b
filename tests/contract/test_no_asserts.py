"""No validation by `assert`: `python -O` (PYTHONOPTIMIZE=1) drops every assert statement, so a check written as one
lets bad input through (a safetensors header that is a JSON list ended in a traceback, exit 1). llmc's and the
backends' code says what is wrong with an exception of its own; only the conformance kit (llmc_cli/testing),
whose asserts are the tests themselves, uses them."""
from __future__ import annotations

import ast
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from llmc_cli.formats.files import CheckpointError
from llmc_cli.formats.safetensors import read_safetensors_header

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "llmc_cli", *sorted(ROOT.glob("backends/*/llmc_*"))]


def asserts_in(package: Path, root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.is_relative_to(root / "llmc_cli" / "testing"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        found += [f"{path.relative_to(root)}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    return found


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_assert_statement_outside_the_conformance_kit(package):
    assert asserts_in(package) == []


def test_the_scan_finds_an_assert_and_spares_the_conformance_kit(tmp_path):
    for rel, text in (("pkg/m.py", "def f(x):\n    assert x, 'no'\n"), ("pkg/ok.py", "x = 1\n"),
                      ("llmc_cli/testing/kit.py", "assert True\n")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert asserts_in(tmp_path, root=tmp_path) == ["pkg/m.py:2"]


def _safetensors(header_json: bytes) -> bytes:
    header_json += b" " * (-len(header_json) % 8)
    return struct.pack("<Q", len(header_json)) + header_json


# headers that are JSON but no object of tensors
NOT_OBJECTS = [b"[]", b"[1, 2]", b'"text"', b"3", b"null", b"true"]


@pytest.mark.parametrize("header", NOT_OBJECTS)
def test_a_header_that_is_not_an_object_is_one_error(tmp_path, header):
    path = tmp_path / "model.safetensors"
    path.write_bytes(_safetensors(header))
    with pytest.raises(CheckpointError, match="not an object of tensors"):
        read_safetensors_header(path)


def test_optimized_python_refuses_a_list_header_in_one_line(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(_safetensors(json.dumps([{"a": 1}]).encode()))
    code = ("import sys; from llmc_cli.formats.safetensors import read_safetensors_header\n"
            "from llmc_cli.formats.files import CheckpointError\n"
            "try:\n    read_safetensors_header(sys.argv[1])\nexcept CheckpointError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-O", "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "not an object of tensors" in r.stdout, r.stdout + r.stderr
