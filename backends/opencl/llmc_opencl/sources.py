"""The OpenCL C sources beside this file, and each kernel's scalar argument types read from them."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
_SCALAR = {"int": np.int32, "long": np.int64, "float": np.float32, "uint": np.uint32, "ulong": np.uint64}


def path(name: str) -> Path:
    return _HERE / name


def source(name: str) -> str:
    return path(name).read_text()


def signatures(src: str) -> dict[str, list]:
    """Scalar argument dtypes per kernel (None for pointers), parsed from our own .cl source."""
    sigs = {}
    for m in re.finditer(r"__kernel\s+(?:__attribute__\s*\(\(.*?\)\)\s*)?void\s+(\w+)\s*\((.*?)\)\s*\{", src,
                         re.S):
        dts = []
        for arg in m.group(2).split(","):
            arg = arg.strip()
            if "*" in arg:
                dts.append(None)
                continue
            words = [w for w in arg.replace("const", " ").split() if w]
            dts.append(_SCALAR[words[0]])
        sigs[m.group(1)] = dts
    return sigs
