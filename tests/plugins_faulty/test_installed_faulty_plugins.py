"""The faulty plugins, installed as a real distribution (a dist-info folder on PYTHONPATH) and run
through the `llmc` process: a probe that sleeps for ever, an import that calls sys.exit, a plugin that prints on
import, probe and create. Every command finishes, --json stays JSON, and a named --backend never probes the hung
plugin."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from faulty_plugins import dist_info, subprocess_env

ENTRY = "from llmc_cli.entry import run; run()"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    d = tmp_path_factory.mktemp("site")
    (d / "adv_exit_on_import_sp.py").write_text("import sys\nsys.exit('bye from import (test)')\n")
    (d / "adv_print_on_import_sp.py").write_text(
        "print('hello from import (test)')\nfrom faulty_plugins import Printer as Plugin\n")
    return dist_info(d, {"hang": "faulty_plugins:HangProbe", "exits": "adv_exit_on_import_sp:Plugin",
                         "printer": "adv_print_on_import_sp:Plugin"}, dist="adv-sub")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from llmc_cli.formats.llmc_bin import write_model
    from llmc_cli.formats.shards import write_shard
    from llmc_cli.models.gpt2 import GPT2Config, init_parameters
    d = tmp_path_factory.mktemp("model")
    cfg = GPT2Config(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)
    write_model(d / "m.bin", cfg, init_parameters(cfg, 0))
    write_shard(d / "tiny_val_000000.bin", np.random.default_rng(0).integers(0, 50257, 200))
    return d


def llmc(site, *args, mark=None, timeout: float = 300):
    env = subprocess_env(site, LLMC_PROBE_TIMEOUT="1", ADV_SUBPROCESS="1",
                         **({"ADV_PROBE_MARK": str(mark)} if mark else {}))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", ENTRY, *map(str, args)], env=env, capture_output=True, text=True, check=False,
                       timeout=timeout)
    r.seconds = time.monotonic() - t0
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_backends_lists_them_all(site):
    r = llmc(site, "backends", "--json")
    assert r.returncode == 0, r.stderr
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    assert rows["cpu"]["usable"] is True
    assert rows["hang"]["usable"] is False and rows["hang"]["reason"].startswith("probe did not answer within 1 s")
    assert rows["exits"]["reason"] == "failed to load: SystemExit: bye from import (test)"
    assert rows["printer"]["usable"] is True
    assert "hello from import" in r.stderr and "hello from probe" in r.stderr
    r = llmc(site, "backends")
    assert r.returncode == 0 and "probe did not answer" in " ".join(r.stdout.split())


def test_a_named_backend_never_probes_the_hung_plugin(site, tmp_path):
    mark = tmp_path / "probed"
    r = llmc(site, "train", "--backend", "cpu", "--model", "d2", "-b", "1", "-t", "8", "--dry-run", mark=mark)
    assert r.returncode == 0, r.stderr
    assert not mark.exists()


def test_eval_json_is_json_whatever_the_plugins_print(site, model, tmp_path):
    args = ["eval", "--checkpoint", model / "m.bin", "--data", str(model / "*val*.bin"), "-b", "1", "-t", "8",
            "--batches", "1", "--json"]
    mark = tmp_path / "probed"
    r = llmc(site, *args, "--backend", "printer", mark=mark)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["loss"] > 0
    assert "hello from create" in r.stderr and not mark.exists()
    r = llmc(site, *args)  # auto: every plugin probed, the hung one for a second at most
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["loss"] > 0
