"""The data thread and the Feed (llmc_cli/data/prefetch.py) on their own: batches and positions in the loader's
order whatever the thread has read ahead, errors handed over at the batch that raised them, waits counted only
when a batch was not ready, and a thread that ends when closed or dropped."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from llmc_cli.data.loader import DataLoader
from llmc_cli.data.prefetch import Feed, ReadAhead, read_batch
from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import write_shard


@pytest.fixture
def data(tmp_path):
    """Three shards of 7 batches of B=2, T=8 for one rank (window 16), 4 for each of two ranks (window 32)."""
    rng = np.random.default_rng(3)
    for i in range(3):
        write_shard(tmp_path / f"p_train_{i:06d}.bin", rng.integers(0, 1000, 7 * 16 + 1))
    return str(tmp_path / "p_train_*.bin")


def cpu_backend():
    from llmc_cpu import CpuBackend
    return CpuBackend()


@pytest.mark.parametrize("kw", [{}, {"shuffle": True, "seed": 5}, {"rank": 1, "world_size": 2, "shuffle": True}],
                         ids=["plain", "shuffle", "rank-1-of-2"])
@pytest.mark.parametrize("overfit", [False, True])
def test_feed_stages_the_batches_and_positions_of_inline_reads(data, kw, overfit):
    """Over two epochs, every staged batch and the position after it equal reading in the step."""
    be = cpu_backend()
    n = 30
    ref_loader = DataLoader(data, 2, 8, **kw)
    ref = [read_batch(ref_loader, overfit) for _ in range(n)]
    x, y = be.alloc((2, 8), "int32"), be.alloc((2, 8), "int32")
    feed = Feed(be, [x, y], DataLoader(data, 2, 8, **kw), overfit=overfit, prefetch=True)
    feed.start()
    try:
        for k, want in enumerate(ref):
            feed.stage()
            np.testing.assert_array_equal(x, want.inputs, err_msg=f"inputs of batch {k}")
            np.testing.assert_array_equal(y, want.targets, err_msg=f"targets of batch {k}")
            assert feed.position == want.position, k
            feed.ahead()
            assert feed.position == want.position, f"batch {k}: a batch put ahead is not taken yet"
    finally:
        feed.close()
    assert feed.batches == n + 1 and 0 <= feed.waits <= feed.batches


def test_close_and_start_again_go_on_from_the_batches_taken(data):
    """A closed thread read past what was taken; the next one starts where the last batch was taken, so nothing
    is skipped or read twice (the batch already in the input queue stays the next)."""
    be = cpu_backend()
    ref_loader = DataLoader(data, 2, 8, shuffle=True)
    ref = [read_batch(ref_loader, False) for _ in range(12)]
    x, y = be.alloc((2, 8), "int32"), be.alloc((2, 8), "int32")
    feed = Feed(be, [x, y], DataLoader(data, 2, 8, shuffle=True))
    got = []
    for k in range(12):
        feed.stage()
        got.append((x.copy(), feed.position))
        feed.ahead()
        if k in (3, 4, 8):
            thread = feed.reader.thread
            feed.close()
            assert not thread.is_alive()
    feed.close()
    for k, (want, (gx, pos)) in enumerate(zip(ref, got)):
        np.testing.assert_array_equal(gx, want.inputs, err_msg=f"batch {k}")
        assert pos == want.position, k


def test_an_error_is_raised_at_the_batch_that_hit_it(data, tmp_path):
    """The second shard holds an id past the vocabulary: the thread meets it reading ahead, and the Feed raises
    the loader's own error when the first batch of that shard is staged, with every batch before it served."""
    bad = np.random.default_rng(0).integers(0, 1000, 7 * 16 + 1)
    bad[20] = 5000
    write_shard(tmp_path / "p_train_000001.bin", bad)
    inline = DataLoader(data, 2, 8, vocab_size=1000)
    for _ in range(7):
        read_batch(inline, False)
    with pytest.raises(DataError) as want:
        read_batch(inline, False)
    be = cpu_backend()
    x, y = be.alloc((2, 8), "int32"), be.alloc((2, 8), "int32")
    feed = Feed(be, [x, y], DataLoader(data, 2, 8, vocab_size=1000))
    for k in range(7):
        feed.stage()
        feed.ahead()
    last_good = feed.position
    assert last_good["shard"] == 0 and last_good["sample"] == 7
    with pytest.raises(DataError) as got:
        feed.stage()
    assert str(got.value) == str(want.value) and "token id 5000" in str(got.value)
    assert feed.position == last_good, "a failed stage takes no batch"
    feed.reader.thread.join(timeout=30)
    assert not feed.reader.thread.is_alive(), "the thread ends after handing its error over"
    feed.close()


def test_waits_count_the_batches_that_were_not_ready(data, monkeypatch):
    """Ready batches are no wait; a batch the thread is still reading when asked for is one."""
    be = cpu_backend()
    gate, real = threading.Event(), DataLoader.next_batch
    count = {"n": 0}

    def gated(self):
        count["n"] += 1
        if count["n"] == 3:  # the third batch: held until the main thread waits for it
            gate.wait()
        return real(self)
    monkeypatch.setattr(DataLoader, "next_batch", gated)
    x, y = be.alloc((2, 8), "int32"), be.alloc((2, 8), "int32")
    feed = Feed(be, [x, y], DataLoader(data, 2, 8), depth=2)
    feed.start()
    q = feed.reader.out
    while not q.full():  # batches 1 and 2 read; the thread holds at the third
        time.sleep(0.01)
    real_get = q.get

    def get(block=True, timeout=None):  # a blocking get: the batch was not ready; let the thread go on
        if block:
            gate.set()
        return real_get(block, timeout)
    q.get = get
    feed.stage()
    feed.ahead()
    assert (feed.waits, feed.batches) == (0, 2)
    feed.stage()
    feed.ahead()
    assert (feed.waits, feed.batches) == (1, 3) and feed.wait_s >= 0
    feed.close()


def test_without_prefetch_every_batch_is_read_in_the_step(data):
    be = cpu_backend()
    x, y = be.alloc((2, 8), "int32"), be.alloc((2, 8), "int32")
    feed = Feed(be, [x, y], DataLoader(data, 2, 8), prefetch=False)
    feed.start()
    assert feed.reader is None
    for _ in range(3):
        feed.stage()
        feed.ahead()
    assert (feed.waits, feed.batches) == (3, 3) and feed.position["sample"] == 3


def test_the_thread_ends_when_the_reader_is_dropped(data):
    """A Trainer that is never closed (a script's, a test's) must not leave its thread reading for ever."""
    r = ReadAhead(DataLoader(data, 2, 8))
    thread = r.thread
    r.next()
    del r
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()
