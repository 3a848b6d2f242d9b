"""docs/skeleton, the tutorial's minimal backend, really is a backend: it passes the whole conformance kit when
given to it as a plugin that is not installed (LLMC_TEST_PLUGIN), and the engine trains GPT-2 on it as on the
cpu backend."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llmc_test_support import KIT_PYTEST

SKELETON = Path(__file__).resolve().parents[2] / "docs" / "skeleton"


def test_the_skeleton_passes_the_conformance_kit(tmp_path):
    pytest.importorskip("torch", reason="the kit's oracle: pip install torch==2.13.0")
    env = dict(os.environ, LLMC_TEST_PLUGIN="llmc_skeleton:SkeletonPlugin",
               PYTHONPATH=os.pathsep.join([str(SKELETON), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(KIT_PYTEST, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", summary)) else 0
    assert r.returncode == 0 and passed > 100 and "failed" not in summary and "error" not in summary, \
        r.stdout[-4000:] + r.stderr[-2000:]


def test_the_engine_trains_on_the_skeleton(shards):
    sys.path.insert(0, str(SKELETON))
    try:
        from llmc_skeleton import SkeletonBackend
    finally:
        sys.path.remove(str(SKELETON))
    from llmc_cli.registry import create_backend
    from llmc_cli.training.args import TrainArgs
    from llmc_cli.training.trainer import Trainer

    def losses(backend) -> list[float]:
        a = TrainArgs(data=str(shards / "*train*.bin"), model="d2", n_embd=64, batch_size=2, seq_len=32, steps=4,
                      val_every=0, sample_every=0)
        t = Trainer(a, backend, say=lambda s: None)
        try:
            return [r["loss"] for r in t.run()]
        finally:
            t.close()

    got, ref = losses(SkeletonBackend()), losses(create_backend("cpu"))
    assert len(got) == 4 and np.allclose(got, ref, rtol=1e-4), (got, ref)
