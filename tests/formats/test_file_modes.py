"""Replacing a file keeps its mode (and its owner where this process may give it away): every llmc write goes
through a temporary sibling renamed over the file (formats/files.atomic_file), which made a user's private log,
config.toml or shard (0600, 0640) come back 0644 after a resume or `tokenize --force`."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from llmc_cli.formats.files import atomic_write_bytes
from llmc_cli.formats.runlog import trim_log
from llmc_cli.formats.shards import write_shard


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def write_plain(path):
    atomic_write_bytes(path, [b"new\n"])


def write_a_shard(path):
    write_shard(path, np.arange(300, dtype=np.uint16))


def trim_a_log(path):
    trim_log(path, 1)


# (what is there before, how llmc rewrites it)
WRITERS = [("plain", b"old\n", write_plain), ("log", b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n', trim_a_log)]


@pytest.mark.parametrize("old_mode", [0o600, 0o640, 0o644, 0o400, 0o755, 0o664])
@pytest.mark.parametrize("name,content,rewrite", WRITERS, ids=[w[0] for w in WRITERS])
def test_a_rewritten_file_keeps_its_mode(tmp_path, old_mode, name, content, rewrite):
    path = tmp_path / name
    path.write_bytes(content)
    os.chmod(path, old_mode)
    rewrite(path)
    assert path.read_bytes() != content
    assert mode(path) == old_mode


@pytest.mark.parametrize("old_mode", [0o600, 0o640])
def test_a_rewritten_shard_keeps_its_mode(tmp_path, old_mode):
    path = tmp_path / "tiny_train_000001.bin"
    write_shard(path, np.arange(100, dtype=np.uint16))
    os.chmod(path, old_mode)
    write_a_shard(path)
    assert path.stat().st_size > 256 * 4 + 200 and mode(path) == old_mode


def test_a_new_file_gets_the_umask_mode(tmp_path):
    was = os.umask(0o027)
    try:
        write_plain(tmp_path / "new")
    finally:
        os.umask(was)
    assert mode(tmp_path / "new") == 0o640


def test_a_file_written_through_its_link_keeps_the_mode_of_the_file(tmp_path):
    target, link = tmp_path / "private.bin", tmp_path / "link.bin"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    link.symlink_to(target)
    atomic_write_bytes(link, [b"new"], through_links=True)
    assert link.is_symlink() and target.read_bytes() == b"new" and mode(target) == 0o600


def test_the_owner_is_kept_where_this_process_may_give_it(tmp_path):
    path = tmp_path / "owned"
    path.write_bytes(b"old")
    other = 12345 if os.geteuid() == 0 else os.geteuid()  # (only root gives a file to another user)
    if os.geteuid() == 0:
        os.chown(path, other, other)
    write_plain(path)
    st = os.stat(path)
    assert (st.st_uid, st.st_gid) == (other, other if os.geteuid() == 0 else st.st_gid)
