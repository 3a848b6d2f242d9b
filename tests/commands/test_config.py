"""llmc train --config run.toml: every option has a key (- or _), flags given override it, a bad file or key is
one line, and the options a run resolved are written to OUT/config.toml, which --config reads back."""

from __future__ import annotations

from llmc_test_support import losses, run


def test_config_file_flags_override_and_the_run_records_its_options(shards, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'backend = "cpu"\nmodel = "d2"\nn-embd = 64\nbatch_size = 2\nseq-len = 32\nsteps = 9\n'
                   f'lr = 1e-3\ndata = "{shards / "*train*.bin"}"\nval-every = 0\nsample-every = 0\n')
    run("train", "--config", cfg, "--steps", 3, "--out", tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").glob("step_*"))[-1] == "step_00000003"  # --steps won
    written = (tmp_path / "a" / "config.toml").read_text()
    assert 'model = "d2"' in written and "steps = 3" in written and "lr = 0.001" in written, written
    run("train", "--config", tmp_path / "a" / "config.toml", "--out", tmp_path / "b")
    assert losses(tmp_path / "b" / "log.jsonl") == losses(tmp_path / "a" / "log.jsonl")


def test_bad_config_is_one_line(tmp_path):
    for text, expect in (("bogus = 1\n", "'bogus' is not an option"), ("lr = [\n", "not valid TOML"),
                         ("lr = -1.0\n", "c.toml: lr must be"), ('lr = "nan"\n', "c.toml: lr must be a finite number"),
                         ("model = [1, 2]\n", "must be a single value")):
        f = tmp_path / "c.toml"
        f.write_text(text)
        r = run("train", "--config", f, "--data", tmp_path / "x.bin", ok=False)
        line = r.output.strip().splitlines()[-1]
        assert r.exit_code == 2 and line.startswith("error:") and expect in line, (text, r.output)
    r = run("train", "--config", tmp_path / "missing.toml", ok=False)
    assert r.exit_code == 2 and "missing.toml" in r.output.strip().splitlines()[-1]
