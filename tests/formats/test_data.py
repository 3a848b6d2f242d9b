"""Shard format (llm.c, magic 20240520), eval file format (20240522: llm.c's version 1, llmc's version 2) and the
data loaders."""
from __future__ import annotations

import os

import numpy as np
import pytest

from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import read_shard, read_shard_header, write_shard
from llmc_cli.data.loader import DataLoader, ValLoader
from llmc_cli.formats.evalfile import read_evalfile, read_evalfile_header, write_evalfile


def llmc_shard_bytes(tokens, magic=20240520, version=1, dtype="<u2") -> bytes:
    """What llm.c's write_datafile produces: 256 int32 (magic, version, count, zeros) + the tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = [magic, version, len(tokens)]
    return header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes()


def make_shards(tmp_path, sizes, seed=0, name="d"):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):
        toks = rng.integers(0, 50257, size=n)
        write_shard(tmp_path / f"{name}_{i:06d}.bin", toks)
        out.append(toks)
    return out


# ---------------------------------------------------------------------------------------------
# format


def test_write_shard_is_llmc_byte_for_byte(tmp_path):
    toks = [50256, 15496, 995, 0, 65535]
    p = write_shard(tmp_path / "a.bin", toks)
    assert p.read_bytes() == llmc_shard_bytes(toks)
    assert p.stat().st_size == 1024 + 2 * len(toks)
    info = read_shard_header(p)
    assert (info.magic, info.version, info.num_tokens, info.tokenizer) == (20240520, 1, 5, "gpt2")
    assert list(read_shard(p)) == toks
    assert list(read_shard(p, mmap=False)) == toks
    assert [f for f in os.listdir(tmp_path)] == ["a.bin"]  # no temp file left behind


def test_llama3_shard_format(tmp_path):
    toks = np.array([128000, 9906, 1917, 128001], dtype=np.int64)
    p = write_shard(tmp_path / "l.bin", toks, tokenizer="llama3")
    assert p.read_bytes() == llmc_shard_bytes(toks, 20240801, 7, "<u4")
    info = read_shard_header(p)
    assert info.tokenizer == "llama3" and info.dtype == np.dtype("<u4")
    assert list(read_shard(p)) == list(toks)


def test_write_shard_refuses_ids_that_do_not_fit(tmp_path):
    with pytest.raises(DataError, match="token id 65536 does not fit the gpt2 shard format"):
        write_shard(tmp_path / "x.bin", [1, 65536])
    with pytest.raises(DataError, match="token id -1"):
        write_shard(tmp_path / "x.bin", np.array([-1, 3]))
    assert not list(tmp_path.iterdir())


def test_bad_magic(tmp_path):
    p = tmp_path / "tok.bin"
    p.write_bytes(llmc_shard_bytes([1, 2, 3], magic=20240328))
    with pytest.raises(DataError, match=r"tok\.bin: bad magic 20240328, expected a token shard.*tokenizer file"):
        read_shard_header(p)


def test_unknown_version(tmp_path):
    p = tmp_path / "v9.bin"
    p.write_bytes(llmc_shard_bytes([1, 2, 3], version=9))
    with pytest.raises(DataError, match=r"v9\.bin: unsupported shard version 9 for magic 20240520"):
        read_shard_header(p)


def test_truncated_and_oversized(tmp_path):
    good = llmc_shard_bytes(list(range(100)))
    p = tmp_path / "cut.bin"
    p.write_bytes(good[:-10])
    with pytest.raises(DataError, match=r"cut\.bin: truncated shard, header says 100 tokens \(1,224 bytes\) "
                                        r"but the file has 1,214 bytes"):
        read_shard_header(p)
    p.write_bytes(good[:500])
    with pytest.raises(DataError, match="shorter than the 1024-byte header"):
        read_shard_header(p)
    p.write_bytes(good + b"\0\0")
    with pytest.raises(DataError, match=r"2 extra"):
        read_shard_header(p)


def test_missing_files_and_empty_glob(tmp_path):
    with pytest.raises(DataError, match=r"no data shards match the pattern '.*\*train\*\.bin'"):
        DataLoader(str(tmp_path / "*train*.bin"), 1, 4)
    with pytest.raises(DataError, match=r"data shard .*nope\.bin not found"):
        DataLoader(str(tmp_path / "nope.bin"), 1, 4)
    with pytest.raises(DataError, match="no .bin shards in directory"):
        DataLoader(str(tmp_path), 1, 4)


def test_shard_too_small_for_a_batch(tmp_path):
    make_shards(tmp_path, [16])
    with pytest.raises(DataError, match=r"d_000000\.bin: 16 tokens is too few .* 2\*2\*4\+1 = 17"):
        DataLoader(str(tmp_path / "*.bin"), 2, 4, world_size=2)


# ---------------------------------------------------------------------------------------------
# loader


def test_batches_sequential_across_shards_and_epochs(tmp_path):
    B, T = 2, 8
    shards = make_shards(tmp_path, [3 * B * T + 1 + 5, 2 * B * T + 1])  # 3 and 2 batches
    dl = DataLoader(str(tmp_path / "d_*.bin"), B, T)
    assert dl.batches_per_epoch == 5 and dl.num_tokens == sum(map(len, shards))
    expect = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    for epoch in range(2):
        for s, i in expect:
            x, y = dl.next_batch()
            buf = shards[s][i * B * T: i * B * T + B * T + 1]
            assert x.dtype == np.int32 and x.shape == (B, T) and y.shape == (B, T)
            np.testing.assert_array_equal(x.ravel(), buf[:-1])
            np.testing.assert_array_equal(y.ravel(), buf[1:])
        assert dl.epoch == epoch
    dl.next_batch()
    assert dl.epoch == 2
    dl.reset()
    x, _ = dl.next_batch()
    np.testing.assert_array_equal(x.ravel(), shards[0][:B * T])


def test_rank_striding(tmp_path):
    B, T, W = 2, 4, 3
    (toks,) = make_shards(tmp_path, [2 * W * B * T + 1])
    loaders = [DataLoader(str(tmp_path / "*.bin"), B, T, rank=r, world_size=W) for r in range(W)]
    assert loaders[0].batches_per_epoch == 2
    for step in range(2):
        for r, dl in enumerate(loaders):
            x, y = dl.next_batch()
            off = step * W * B * T + r * B * T
            np.testing.assert_array_equal(x.ravel(), toks[off: off + B * T])
            np.testing.assert_array_equal(y.ravel(), toks[off + 1: off + B * T + 1])
    with pytest.raises(DataError, match="rank 3 is not in 0..2"):
        DataLoader(str(tmp_path / "*.bin"), B, T, rank=3, world_size=3)


def _offsets(dl, n):
    """Which (shard file, token offset) each of the next n batches came from."""
    out = []
    for _ in range(n):
        x, _ = dl.next_batch()
        out.append((dl._file, x.ravel()[:3].tolist()))
    return out


def test_shuffle_is_a_seeded_permutation_per_epoch(tmp_path):
    B, T = 1, 8
    shards = make_shards(tmp_path, [10 * B * T + 1, 7 * B * T + 1, 4 * B * T + 1])
    pat = str(tmp_path / "*.bin")
    n = 21
    a = DataLoader(pat, B, T, shuffle=True, seed=7)
    b = DataLoader(pat, B, T, shuffle=True, seed=7)
    c = DataLoader(pat, B, T, shuffle=True, seed=8)
    ea, eb = _offsets(a, 2 * n), _offsets(b, 2 * n)
    assert ea == eb  # deterministic from the seed
    assert ea != _offsets(c, 2 * n)
    seq = [(s, i) for s, sz in enumerate([10, 7, 4]) for i in range(sz)]
    first = {(f, tuple(v)) for f, v in ea[:n]}
    every = {(s, tuple(shards[s][i * T: i * T + 3].tolist())) for s, i in seq}
    assert first == every  # each epoch visits every sample exactly once
    assert {(f, tuple(v)) for f, v in ea[n:]} == every
    assert ea[:n] != ea[n:]  # a new permutation each epoch
    plain = _offsets(DataLoader(pat, B, T), n)
    assert plain != ea[:n] and sorted(plain) == sorted(ea[:n])


@pytest.mark.parametrize("shuffle", [False, True])
def test_state_restore_is_exact(tmp_path, shuffle):
    B, T = 2, 4
    make_shards(tmp_path, [5 * B * T + 1, 3 * B * T + 3, 4 * B * T + 1])
    pat = str(tmp_path / "*.bin")
    ref = DataLoader(pat, B, T, shuffle=shuffle, seed=3)
    for _ in range(9):  # into shard 2 of epoch 0
        ref.next_batch()
    st = ref.state()
    assert st["epoch"] == 0 and st["sample"] >= 1 and set(st) >= {"shard", "sample", "epoch"}
    import json

    st = json.loads(json.dumps(st))  # goes through a JSON checkpoint
    cont = DataLoader(pat, B, T, shuffle=shuffle, seed=3)
    cont.load_state(st)
    for _ in range(20):  # across the epoch boundary
        x1, y1 = ref.next_batch()
        x2, y2 = cont.next_batch()
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    assert cont.state() == ref.state()


def test_load_state_refuses_a_different_setup(tmp_path):
    make_shards(tmp_path, [100])
    pat = str(tmp_path / "*.bin")
    st = DataLoader(pat, 2, 4).state()
    with pytest.raises(DataError, match="B 2 -> 3"):
        DataLoader(pat, 3, 4).load_state(st)


def test_token_ids_checked_against_the_model_vocab(tmp_path):
    write_shard(tmp_path / "a_000000.bin", np.arange(40) % 50)
    write_shard(tmp_path / "b_000001.bin", [1] * 20 + [60000] + [2] * 19)
    pat = str(tmp_path / "*.bin")
    dl = DataLoader(pat, 1, 8, vocab_size=50257)  # first shard is fine
    with pytest.raises(DataError, match=r"b_000001\.bin: token id 60000 at position 20 is >= the model's vocab size 50,257"):
        dl.check_vocab()
    with pytest.raises(DataError, match=r"a_000000\.bin: token id 30 at position 30"):
        DataLoader(pat, 1, 8, vocab_size=30)
    dl = DataLoader(pat, 1, 8, vocab_size=50257)
    for _ in range(4):
        dl.next_batch()
    with pytest.raises(DataError, match=r"b_000001\.bin: token id 60000"):
        dl.next_batch()  # checked when the shard is first opened


def test_val_loader_reads_in_order_from_the_start(tmp_path):
    B, T = 2, 4
    (toks,) = make_shards(tmp_path, [5 * B * T + 1])
    vl = ValLoader(str(tmp_path / "*.bin"), B, T)
    assert vl.num_batches == 5
    for _ in range(2):  # every pass restarts at the beginning
        got = [x.ravel() for x, _ in vl.batches(3)]
        for i, x in enumerate(got):
            np.testing.assert_array_equal(x, toks[i * B * T: (i + 1) * B * T])
    assert len(list(vl)) == 5 and len(list(vl.batches(0))) == 5 and len(list(vl.batches(99))) == 5


# ---------------------------------------------------------------------------------------------
# eval files (HellaSwag)


def expected_evalfile(examples, tokenizer=None) -> bytes:
    """The llm.c eval layout (version 1, uint16), spelled out independently of llmc_cli; with `tokenizer`,
    llmc's version 2: the same fields in uint32 (delimiter 2**32-1), the tokenizer's name in header ints 4..11."""
    width, dtype = (2, "<u2") if tokenizer is None else (4, "<u4")
    stream, longest = [], 0
    for idx, ex in enumerate(examples):
        body = [idx, ex["label"], len(ex["ending_tokens"]), len(ex["ctx_tokens"]), *ex["ctx_tokens"]]
        for e in ex["ending_tokens"]:
            body += [len(e), *e]
        nbytes = width * (len(body) + 2)
        longest = max(longest, nbytes)
        stream += [2 ** (8 * width) - 1, nbytes, *body]
    header = np.zeros(256, dtype="<i4")
    header[:4] = [20240522, 1 if tokenizer is None else 2, len(examples), longest]
    head = bytearray(header.tobytes())
    if tokenizer is not None:
        head[16:16 + len(tokenizer)] = tokenizer.encode()
    return bytes(head) + np.asarray(stream, dtype=dtype).tobytes()


LLAMA_EXS = [{"label": 2, "ctx_tokens": [128000, 791, 7160], "ending_tokens": [[128255], [1, 65535], [70000], [0]]},
             {"label": 1, "ctx_tokens": [128000], "ending_tokens": [[5], [6, 7], [8], [9, 100000]]}]


def test_evalfile_llama3_round_trip(tmp_path):
    """Llama 3 ids (up to 128,255, past uint16) in llmc's version 2, which names its tokenizer."""
    p = write_evalfile(tmp_path / "hs.bin", LLAMA_EXS, tokenizer="llama3")
    assert p.read_bytes() == expected_evalfile(LLAMA_EXS, "llama3")
    back = read_evalfile(p)
    assert [{k: v for k, v in e.items() if k != "index"} for e in back] == LLAMA_EXS
    info = read_evalfile_header(p)
    assert (info.version, info.tokenizer, info.num_examples) == (2, "llama3", 2)
    # the same examples cannot go to llm.c's uint16 file, nor to a tokenizer without a format
    with pytest.raises(DataError, match=r"x\.bin: example 0 has a token id outside 0\.\.65534 \(gpt2"):
        write_evalfile(tmp_path / "x.bin", LLAMA_EXS)
    with pytest.raises(DataError, match="no eval file format for tokenizer 'bert'"):
        write_evalfile(tmp_path / "x.bin", LLAMA_EXS, tokenizer="bert")
    assert not (tmp_path / "x.bin").exists()
    # a GPT-2 file is still llm.c's version 1, and says so
    g = write_evalfile(tmp_path / "g.bin", [{"label": 0, "ctx_tokens": [1], "ending_tokens": [[2], [3], [4], [5]]}])
    assert read_evalfile_header(g).tokenizer == "gpt2" and read_evalfile_header(g).version == 1
    # one kind of eval file replaces the other (both llmc's), never a file that is not an eval file
    write_evalfile(g, LLAMA_EXS, tokenizer="llama3")
    assert read_evalfile_header(g).tokenizer == "llama3"


def test_evalfile_reads_llm_c_bytes(tmp_path):
    """A file as llm.c writes it (spelled out above, not by llmc) reads back as the same examples: GPT-2's."""
    exs = [{"label": 1, "ctx_tokens": [464, 3797], "ending_tokens": [[318], [1, 65534], [3, 4, 5], [6]]}]
    p = tmp_path / "llmc_c.bin"
    p.write_bytes(expected_evalfile(exs))
    assert [{k: v for k, v in e.items() if k != "index"} for e in read_evalfile(p)] == exs
    assert read_evalfile_header(p).tokenizer == "gpt2"


def _evalfile_with(path, ints=None, name=None, cut=0, extra=b""):
    data = bytearray(expected_evalfile(LLAMA_EXS, "llama3"))
    for i, v in (ints or {}).items():
        data[4 * i: 4 * i + 4] = int(v).to_bytes(4, "little", signed=True)
    if name is not None:
        data[16:48] = name.ljust(32, b"\0")
    path.write_bytes(bytes(data[:len(data) - cut]) + extra)
    return path


@pytest.mark.parametrize("case, expect", [
    ("version", ("unsupported eval file version 3; this llmc reads version 1 (gpt2, 16-bit tokens), version 2 "
                 "(llama3, 32-bit tokens)")),
    ("magic", "bad magic 20240520, expected 20240522"),
    ("no_name", "eval file version 2 names tokenizer '', expected one of llama3"),
    ("other_name", "eval file version 2 names tokenizer 'gpt5', expected one of llama3"),
    ("header", "truncated eval file, 1000 bytes is shorter than the 1024-byte header"),
    ("ragged", "is not a whole number of 32-bit tokens"),
    ("cut", "truncated in example 1"),
    ("trailing", "8 trailing bytes after 2 examples"),
    ("count", "example 2 does not start with the 4294967295 delimiter"),
])
def test_evalfile_errors_are_one_line_naming_the_file(tmp_path, case, expect):
    p = tmp_path / "hs.bin"
    if case == "version":
        _evalfile_with(p, {1: 3})
    elif case == "magic":
        _evalfile_with(p, {0: 20240520})
    elif case == "no_name":
        _evalfile_with(p, name=b"")
    elif case == "other_name":
        _evalfile_with(p, name=b"gpt5")
    elif case == "header":
        p.write_bytes(expected_evalfile(LLAMA_EXS, "llama3")[:1000])
    elif case == "ragged":
        _evalfile_with(p, cut=2)
    elif case == "cut":
        _evalfile_with(p, cut=4)
    elif case == "trailing":
        _evalfile_with(p, extra=bytes(8))
    else:
        _evalfile_with(p, {2: 3})
    with pytest.raises(DataError) as e:
        read_evalfile(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and expect in msg and "\n" not in msg, msg
    if case in ("version", "magic", "no_name", "other_name", "header"):  # the header alone says so too
        with pytest.raises(DataError, match="^" + str(p)):
            read_evalfile_header(p)


def test_evalfile_round_trip(tmp_path):
    exs = [{"label": 3, "ctx_tokens": [32, 582], "ending_tokens": [[318], [1, 2], [3, 4, 5], [6]]},
           {"label": 0, "ctx_tokens": [50256], "ending_tokens": [[7], [8], [9], [10, 11]]}]
    p = write_evalfile(tmp_path / "hs.bin", exs)
    assert p.read_bytes() == expected_evalfile(exs)
    back = read_evalfile(p)
    assert [{k: v for k, v in e.items() if k != "index"} for e in back] == exs
    assert [e["index"] for e in back] == [0, 1]
    with pytest.raises(DataError, match="3 completions"):
        write_evalfile(tmp_path / "x.bin", [{"label": 0, "ctx_tokens": [1], "ending_tokens": [[1], [2], [3]]}])
    p.write_bytes(p.read_bytes()[:-2])
    with pytest.raises(DataError, match="hs.bin: truncated in example 1"):
        read_evalfile(p)
