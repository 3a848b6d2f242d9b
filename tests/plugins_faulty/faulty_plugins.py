"""Broken third-party backend plugins, each breaking the contract one way (docs/writing-a-backend.md), and the
entry points that install them without pip: `ep("name", "faulty_plugins:Class")` for `registry._entry_points`
in-process, `dist_info(dir, {...})` for a subprocess (a *.dist-info folder on PYTHONPATH is an installed
distribution to importlib.metadata)."""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
from llmc_cpu import CpuBackend

from llmc_cli.kernels import CAP_KV_CACHE, CAP_REFERENCE, FLOAT32, Backend, BackendPlugin, BackendUnavailable
from llmc_cli.registry import GROUP

HERE = Path(__file__).resolve().parent
RELEASE = threading.Event()  # set when a test ends: an in-process hung probe's thread then returns
PROBED: list[str] = []       # plugins whose probe ran (a named --backend must probe no other)


class EP:
    """An entry point of group llmc.backends from distribution `dist`, as importlib.metadata gives one."""

    def __init__(self, name: str, value: str, dist: str | None = "adv-test") -> None:
        self.name, self.value, self.group = name, value, GROUP
        self.dist = types.SimpleNamespace(name=dist) if dist else None

    def load(self):
        mod, _, attr = self.value.partition(":")
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


def ep(name: str, attr: str, dist: str | None = "adv-test") -> EP:
    """An entry point to `attr` of this module (or "module:attr" as given)."""
    return EP(name, attr if ":" in attr else f"faulty_plugins:{attr}", dist)


def dist_info(site: Path, entries: dict[str, str], dist: str = "adv-test") -> Path:
    """A distribution `dist` installed into folder `site` (no pip) registering `entries` (name -> module:attr)."""
    d = site / f"{dist.replace('-', '_')}-0.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0\n")
    (d / "entry_points.txt").write_text(f"[{GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    return site


def subprocess_env(site: Path, **extra: str) -> dict[str, str]:
    """The environment of an `llmc` subprocess that sees the distributions in `site` and this module."""
    path = os.pathsep.join([str(site), str(HERE), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, **extra)


# ---------------------------------------------------------------------------------------------------------------
# backends

class OffGelu(CpuBackend):
    """The numpy backend with gelu_forward 1% too large."""

    def gelu_forward(self, out, inp):
        super().gelu_forward(out, inp)
        out *= 1.01


class NotImplementedGelu(CpuBackend):
    def gelu_forward(self, out, inp):
        raise NotImplementedError("gelu_forward is not written yet (test)")


class KvWithoutDecode(CpuBackend):
    """Announces kv_cache without implementing attention_decode (the base class's NotImplementedError)."""

    capabilities = frozenset({CAP_KV_CACHE})

    def attention_decode(self, *a, **k):
        return Backend.attention_decode(self, *a, **k)


class CapsNone(CpuBackend):
    capabilities = None


class Half(Backend):
    """Lacks every abstract kernel: instantiating it raises TypeError."""


class OffReference(OffGelu):
    capabilities = frozenset({CAP_REFERENCE})


# ---------------------------------------------------------------------------------------------------------------
# plugins

class Fake(BackendPlugin):
    """A correct plugin: the numpy backend under another name, below cpu."""

    name = "fake"
    priority = -10
    default_dtype = FLOAT32
    backend_class = CpuBackend

    def probe(self):
        PROBED.append(type(self).__name__)
        return True, "fake plugin (test)"

    def create(self, device=None, dtype=None, options=None):
        if dtype not in (None, FLOAT32):
            raise BackendUnavailable("float32 only (test)")
        return self.backend_class()


class Honest(Fake):
    def probe(self):
        return False, "no such device here (test)"


class HangProbe(Fake):
    def probe(self):
        PROBED.append("HangProbe")
        if mark := os.environ.get("ADV_PROBE_MARK"):
            Path(mark).write_text("probed")
        if os.environ.get("ADV_SUBPROCESS"):  # (a real process: never answers)
            time.sleep(10**6)
        RELEASE.wait()  # in-process: until the test ends, so that no thread outlives the test for long
        return True, "woke up (test)"


class BadPriority(Fake):
    priority = "high"


class NanPriority(Fake):
    priority = float("nan")


class BadName(Fake):
    name = 7


class BadOptions(Fake):
    options = ["threads"]  # noqa: RUF012  (the wrong type on purpose)


class BadDtype(Fake):
    default_dtype = "fp16"


class BadReference(Fake):
    reference = "yes"


class ProbeSetsBadPriority(Fake):
    def probe(self):
        self.priority = "lower"
        return True, "changed my priority (test)"


NOT_A_PLUGIN = 42


class NotAPlugin:
    name = "notaplugin"

    def probe(self):
        return True, "duck (test)"


class ExitInProbe(Fake):
    def probe(self):
        sys.exit("bye from probe (test)")


class ExitInInit(Fake):
    def __init__(self):
        sys.exit("bye from __init__ (test)")


class RaiseInInit(Fake):
    def __init__(self):
        raise RuntimeError("ctor boom (test)")


class ProbeDict(Fake):
    def probe(self):
        return True, {"device": np.float32(1.5)}


class ProbeStr(Fake):
    def probe(self):
        return "ok"


class ProbeNoStr(Fake):
    def probe(self):
        return ("no", "a string is not a bool (test)")


class ProbeNone(Fake):
    def probe(self):
        return None


class ProbeRaises(Fake):
    def probe(self):
        raise RuntimeError("probe boom (test)")


class ProbeNumpyBool(Fake):
    def probe(self):
        return np.True_, "numpy bool (test)"


class ProbeMultiline(Fake):
    def probe(self):
        return False, "first line\nsecond line\x1b[31m red\r\n"


class DevicesRaise(Fake):
    def devices(self):
        raise RuntimeError("devices boom (test)")


class DevicesOdd(Fake):
    def devices(self):
        return [np.float32(1.5), "dev\n1"]


class Printer(Fake):
    def __init__(self):
        print("hello from __init__ (test)")

    def probe(self):
        print("hello from probe (test)")
        return True, "prints (test)"

    def create(self, device=None, dtype=None, options=None):
        print("hello from create (test)")
        return super().create(device, dtype, options)


class CreateRaises(Fake):
    def create(self, device=None, dtype=None, options=None):
        raise RuntimeError("create boom (test)")


class CreateNone(Fake):
    def create(self, device=None, dtype=None, options=None):
        return None


class CreateExit(Fake):
    def create(self, device=None, dtype=None, options=None):
        sys.exit("bye from create (test)")


class ScratchRaises(Fake):
    def planned_scratch(self, dtype, options=None, attention=None):
        raise RuntimeError("scratch boom (test)")


class ScratchExit(Fake):
    def planned_scratch(self, dtype, options=None, attention=None):
        sys.exit("bye from planned_scratch (test)")


class ScratchNone(Fake):
    def planned_scratch(self, dtype, options=None, attention=None):
        return None


class ScratchNegative(Fake):
    def planned_scratch(self, dtype, options=None, attention=None):
        return {"lib workspace": -1}


class ScratchWithoutAttention(Fake):
    """A plugin written before planned_scratch took the model's attention shape."""

    def planned_scratch(self, dtype, options=None):
        return {"lib workspace": 1 << 30}


class ScratchKeywords(Fake):
    def planned_scratch(self, dtype, options=None, **kw):
        return {"per score": 2 * kw["attention"][1] ** 2}


class ScratchPositional(Fake):
    def planned_scratch(self, dtype, options, attention, /):
        return {"per score": 2 * attention[1] ** 2}


class ScratchOfTheShape(Fake):
    def planned_scratch(self, dtype, options=None, attention=None):
        B, T, NH, NKV, hd = attention
        return {"per score": 2 * B * NH * T * T}


class CreateHalf(Fake):
    backend_class = Half


class CreateCapsNone(Fake):
    backend_class = CapsNone


class CreateGeluNotImplemented(Fake):
    backend_class = NotImplementedGelu


class CreateKvWithoutDecode(Fake):
    backend_class = KvWithoutDecode


class BrokenCpu(Fake):
    """A second 'cpu' from another distribution, whose probe raises."""

    name = "cpu"
    priority = 1000

    def probe(self):
        raise RuntimeError("broken duplicate (test)")


class LoudReference(Fake):
    """Declares itself a reference above cpu's priority, with a gelu 1% off."""

    name = "loudref"
    priority = 50
    reference = True
    backend_class = OffReference
