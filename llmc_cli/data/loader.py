"""The training and validation data loaders over token shards (the format is formats/shards.py).

``DataLoader`` follows llm.c's ``llmc/dataloader.h``: the sorted glob of shards, every batch is
``B*T+1`` contiguous tokens (inputs = first B*T, targets = the same shifted by one), rank r of W reads
the r-th ``B*T`` slice of each ``W*B*T`` window, a shard serves ``(ntok-1) // (W*B*T)`` samples and then
the loader moves to the next shard, wrapping around (epoch += 1) after the last. With ``shuffle`` the
shard order and the sample order inside each shard are permuted per epoch, from the seed only (every
rank draws the same permutation, so ranks keep reading disjoint slices of the same windows).
``state()`` / ``load_state()`` save and restore the exact position.
"""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from llmc_cli.formats.files import DataError
from llmc_cli.formats.shards import HEADER_BYTES, MAX_TOKENS, ShardInfo, read_shard_header, resolve_shards

SCAN_TOKENS = 1 << 22  # tokens read at a time when a shard is checked against the vocabulary

# ----------------------------------------------------------------------------------------------
# loaders


def _int_arg(name: str, v, lo: int, extra: str = "") -> int:
    """`v` as a Python int when it is an integer (numpy's too; never a bool, a float such as 4.7, or NaN) >= lo,
    else a DataError naming the argument."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < lo:
        raise DataError(f"{name} must be an integer >= {lo}{' ' + extra if extra else ''} (got {v!r})")
    return int(v)


def _describe(info: ShardInfo) -> str:
    return f"{info.num_tokens:,} {info.tokenizer} tokens"


class DataSetupChanged(DataError):
    """A saved position that cannot be continued with this loader: `changes` maps what differs (num_shards, B, T,
    world_size, shuffle, seed; shard_file: the name of the shard at the saved position) to (then, now), so that a
    caller can name its own options for them (the trainer: --data, -b, --shuffle)."""

    def __init__(self, changes: dict[str, tuple], shard: int | None = None):
        self.changes, self.shard = changes, shard
        said = ", ".join(f"shard {shard} {a!r} -> {b!r}" if k == "shard_file" else f"{k} {a!r} -> {b!r}"
                         for k, (a, b) in changes.items())
        super().__init__(f"cannot resume the data position, the data setup changed: {said}")


class DataLoader:
    """Distributed, optionally shuffled loader over token shards (llm.c's semantics).

    ``next_batch()`` -> ``(inputs, targets)``, each a fresh ``(B, T)`` int32 array.
    ``vocab_size``: when given, every shard is checked (once, when first opened; or all at once with
    :meth:`check_vocab`) to hold only ids ``< vocab_size``, else :class:`DataError` naming the shard.
    """

    STATE_VERSION = 1

    SPLIT = "train"  # what a directory given as `pattern` contributes (llm.c's NAME_train_* shards)

    def __init__(self, pattern, B: int, T: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = False, seed: int = 42, vocab_size: int | None = None):
        if not (isinstance(pattern, (str, os.PathLike)) or (isinstance(pattern, (list, tuple)) and pattern and all(
                isinstance(p, (str, os.PathLike)) for p in pattern))):
            raise DataError(f"shards must be a directory, a glob or a list of shard paths (got {pattern!r:.80})")
        B, T, world_size = (_int_arg(n, v, 1) for n, v in (("B", B), ("T", T), ("world_size", world_size)))
        rank = _int_arg("rank", rank, 0)
        if B * T * world_size > MAX_TOKENS:  # (a window's offsets are int32 in the kernels and the shard format)
            raise DataError(f"B*T*world_size = {B}*{T}*{world_size} = {B * T * world_size:,} tokens a batch, more "
                            f"than a shard can hold ({MAX_TOKENS:,})")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in 0..{world_size - 1}")
        if not isinstance(shuffle, (bool, np.bool_)):
            raise DataError(f"shuffle must be True or False (got {shuffle!r})")
        seed = _int_arg("seed", seed, 0)
        if vocab_size is not None:
            vocab_size = _int_arg("vocab_size", vocab_size, 1, "or None (no check)")
        self.B, self.T = B, T
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = bool(shuffle), seed
        self.vocab_size = vocab_size
        self._checked_for: set[tuple[int, int]] = set()  # (shard, vocab size) checked for another vocab size
        self.pattern = pattern
        self.files = resolve_shards(pattern, split=self.SPLIT)
        self.infos = [read_shard_header(f) for f in self.files]
        need = self.world_size * self.B * self.T + 1
        for info in self.infos:
            if info.num_tokens < need:
                raise DataError(
                    f"{info.path}: {info.num_tokens:,} tokens is too few for one batch of "
                    f"world_size*B*T+1 = {self.world_size}*{self.B}*{self.T}+1 = {need:,} tokens")
        other = next((i for i in self.infos if i.tokenizer != self.infos[0].tokenizer), None)
        if other is not None:  # one id would stand for two words: a model cannot learn from both at once
            raise DataError(f"{other.path} is tokenized with {other.tokenizer} but {self.infos[0].path} with "
                            f"{self.infos[0].tokenizer}; give shards of one tokenizer")
        self.tokenizers = sorted({i.tokenizer for i in self.infos})
        self.num_tokens = sum(i.num_tokens for i in self.infos)
        self._window = self.world_size * self.B * self.T
        self._checked: set[int] = set()
        # each shard's (device, inode, mtime) when its ids were checked: a shard replaced later is checked again
        self._ident: dict[int, tuple] = {}
        # the shard being read, through reads at offsets rather than a memory map: a map of a file cut short under
        # it (`cp` or `truncate` onto the shard) kills the process with SIGBUS, where a read comes back short
        self._fh = None
        self._mm_file = -1
        self._perm_key = None
        self._perm = None
        self.reset()

    # -- geometry
    @property
    def num_shards(self) -> int:
        return len(self.files)

    def shard_samples(self, file_index: int) -> int:
        """Batches (windows of world_size*B*T) a shard serves: llm.c's (ntok-1) // (W*B*T)."""
        return (self.infos[file_index].num_tokens - 1) // self._window

    @property
    def batches_per_epoch(self) -> int:
        return sum(self.shard_samples(i) for i in range(self.num_shards))

    @property
    def tokenizer(self) -> str:
        """The vocabulary the shards' format records ("gpt2" / "llama3"; "mixed" if they differ)."""
        return self.tokenizers[0] if len(self.tokenizers) == 1 else "mixed"

    # -- permutations (pure functions of seed, epoch, position: nothing to save but the position)
    def _shard_order(self, epoch: int) -> np.ndarray:
        n = self.num_shards
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(n)

    def files_read(self, state: dict) -> list[int]:
        """Indices into `files` of the shards a run at position `state` (this loader's setup) has begun to read."""
        epoch, shard = int(state.get("epoch", 0)), int(state.get("shard", 0))
        return list(range(self.num_shards)) if epoch > 0 else [int(i) for i in self._shard_order(0)[:shard + 1]]

    def _sample_order(self, epoch: int, shard_pos: int, file_index: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        key = (epoch, shard_pos, file_index)
        if self._perm_key != key:  # cached: --overfit-batch resets every step
            n = self.shard_samples(file_index)
            self._perm = np.random.default_rng([self.seed, epoch, 1 + shard_pos]).permutation(n)
            self._perm_key = key
        return self._perm

    def __del__(self) -> None:  # (the shard being read stays open between batches; a dropped loader closes it)
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()

    # -- position
    def reset(self) -> None:
        """Back to the first batch of epoch 0."""
        self._set_position(0, 0, 0)

    def _set_position(self, epoch: int, shard_pos: int, sample: int) -> None:
        self.epoch, self.shard_pos, self.sample = epoch, shard_pos, sample
        self._order = self._shard_order(epoch)
        self._file = int(self._order[shard_pos])
        self._samples = self._sample_order(epoch, shard_pos, self._file)
        self._open(self._file)

    def _open_checked(self, file_index: int):
        """The shard opened for reading, refused when it is no longer the shard the loader was made over (a run's
        positions and sample counts come from the sizes it had then)."""
        path, was = self.files[file_index], self.infos[file_index]
        now = read_shard_header(path)
        fh = open(path, "rb", buffering=0)
        try:
            st = os.fstat(fh.fileno())
            if (now.num_tokens, now.dtype) != (was.num_tokens, was.dtype) or st.st_size != was.nbytes:
                raise DataError(f"{path}: changed since the data was opened ({_describe(was)} then, now "
                                f"{_describe(now) if st.st_size == now.nbytes else f'{st.st_size:,} bytes'}); "
                                "the shards must stay as they are while a run reads them")
        except BaseException:
            fh.close()
            raise
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if self._ident.get(file_index, ident) != ident:  # replaced by a file of the same size: its ids are new
            self._checked.discard(file_index)
            self._checked_for = {c for c in self._checked_for if c[0] != file_index}
        self._ident[file_index] = ident
        return fh

    def _open(self, file_index: int) -> None:
        if self._mm_file != file_index:
            if self._fh is not None:
                self._fh.close()
                self._fh, self._mm_file = None, -1
            self._fh = self._open_checked(file_index)
            self._mm_file = file_index
        if self.vocab_size is not None and file_index not in self._checked:
            self._check_shard(file_index, self._fh)

    def _pread(self, fh, file_index: int, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of a shard; a file cut short under the reader is a DataError."""
        info = self.infos[file_index]
        size = info.dtype.itemsize
        want, at, parts = count * size, HEADER_BYTES + start * size, []
        while want > 0:
            b = os.pread(fh.fileno(), want, at)
            if not b:
                raise DataError(f"{self.files[file_index]}: cut short while it was read (the header says "
                                f"{info.num_tokens:,} tokens; the file ends before token {start + count:,}); the "
                                "shards must stay as they are while a run reads them")
            parts.append(b)
            want, at = want - len(b), at + len(b)
        return np.frombuffer(b"".join(parts) if len(parts) != 1 else parts[0], dtype=info.dtype)

    def _check_shard(self, file_index: int, fh=None, vocab_size: int | None = None) -> None:
        V = self.vocab_size if vocab_size is None else vocab_size
        if fh is None:
            with self._open_checked(file_index) as f:
                return self._check_shard(file_index, f, vocab_size)
        n = self.infos[file_index].num_tokens
        for start in range(0, n, SCAN_TOKENS):  # (in pieces: a shard of 2**31 ids is 4-8 GB)
            tokens = self._pread(fh, file_index, start, min(SCAN_TOKENS, n - start))
            if int(tokens.max()) >= V:
                where = int(np.argmax(tokens >= V))
                raise DataError(
                    f"{self.files[file_index]}: token id {int(tokens[where])} at position {start + where:,} is >= "
                    f"the model's vocab size {V:,} (shard format: "
                    f"{self.infos[file_index].tokenizer}; tokenized with a different vocabulary?)")
        if V == self.vocab_size:
            self._checked.add(file_index)
        else:
            self._checked_for.add((file_index, V))

    def check_vocab(self, vocab_size: int | None = None) -> None:
        """Check every shard now for ids >= vocab_size (default: the loader's vocab_size)."""
        if vocab_size is not None:
            if vocab_size != self.vocab_size:
                self._checked.clear()
            self.vocab_size = vocab_size
        if self.vocab_size is None:
            raise DataError("check_vocab needs a vocab_size")
        for i in range(self.num_shards):
            if i not in self._checked:
                self._check_shard(i)

    def _advance_shard(self) -> None:
        if self.shard_pos + 1 >= self.num_shards:
            self._set_position(self.epoch + 1, 0, 0)
        else:
            self._set_position(self.epoch, self.shard_pos + 1, 0)

    def _read(self, idx: int):
        off = idx * self._window + self.rank * self.B * self.T
        buf = self._pread(self._fh, self._file, off, self.B * self.T + 1).astype(np.int32)
        x = buf[:-1].reshape(self.B, self.T)
        y = buf[1:].reshape(self.B, self.T)
        return x, y  # two views of one fresh buffer; callers own them

    def next_batch(self):
        """The next (inputs, targets) pair, moving to the next shard / epoch when one is used up."""
        if self.sample >= self.shard_samples(self._file):
            self._advance_shard()
        idx = self.sample if self._samples is None else int(self._samples[self.sample])
        self.sample += 1
        return self._read(idx)

    def __iter__(self) -> Iterator:
        while True:
            yield self.next_batch()

    # -- resumability
    def state(self) -> dict:
        """The exact position as a small JSON-able dict (goes into checkpoints)."""
        return {
            "version": self.STATE_VERSION, "epoch": self.epoch, "shard": self.shard_pos,
            "sample": self.sample, "shard_file": os.path.basename(self.files[self._file]),
            "num_shards": self.num_shards, "B": self.B, "T": self.T, "world_size": self.world_size,
            "shuffle": self.shuffle, "seed": self.seed,
        }

    def load_state(self, state: dict) -> None:
        """Continue exactly where :meth:`state` was taken (same shards, B, T, world size, shuffling)."""
        if int(state.get("version", -1)) != self.STATE_VERSION:
            raise DataError(f"data loader state version {state.get('version')!r} is not {self.STATE_VERSION}")
        now = {"num_shards": self.num_shards, "B": self.B, "T": self.T, "world_size": self.world_size,
               "shuffle": self.shuffle}
        if self.shuffle:
            now["seed"] = self.seed
        changes = {k: (state.get(k), v) for k, v in now.items() if state.get(k) != v}
        if changes:
            raise DataSetupChanged(changes)
        epoch, shard, sample = int(state["epoch"]), int(state["shard"]), int(state["sample"])
        if not 0 <= shard < self.num_shards:
            raise DataError(f"data loader state: shard {shard} out of range 0..{self.num_shards - 1}")
        file = int(self._shard_order(epoch)[shard])
        name = os.path.basename(self.files[file])
        if name != state.get("shard_file", name):  # (checked before it is opened: the setup, not the file, is wrong)
            raise DataSetupChanged({"shard_file": (state["shard_file"], name)}, shard)
        self._set_position(epoch, shard, sample)
        if not 0 <= sample <= self.shard_samples(self._file):
            raise DataError(f"data loader state: sample {sample} out of range for {self.files[self._file]}")


class ValLoader(DataLoader):
    """Validation / eval batches: in order from the start of the first shard, one pass, no shuffling."""

    SPLIT = "val"

    def __init__(self, pattern, B: int, T: int, rank: int = 0, world_size: int = 1,
                 vocab_size: int | None = None):
        super().__init__(pattern, B, T, rank=rank, world_size=world_size, shuffle=False,
                         vocab_size=vocab_size)

    @property
    def num_batches(self) -> int:
        return self.batches_per_epoch

    def check_vocab_of_batches(self, n: int | None = None, vocab_size: int | None = None) -> None:
        """Check, now, every shard the first ``n`` batches (None or 0: all) read for ids >= vocab_size (default: the
        loader's; a model's, when the loader was made without one or with a larger one): a run that validates would
        otherwise meet a bad later val shard only at its first validation, mid-run."""
        total = self.num_batches if not n or n <= 0 else min(int(n), self.num_batches)
        if vocab_size == self.vocab_size:
            vocab_size = None
        covered = 0
        for i in range(self.num_shards):
            if covered >= total:
                break
            if vocab_size is not None:
                if (i, vocab_size) not in self._checked_for:
                    self._check_shard(i, vocab_size=vocab_size)
            elif self.vocab_size is not None and i not in self._checked:
                self._check_shard(i)
            covered += self.shard_samples(i)

    def batches(self, n: int | None = None) -> Iterator:
        """Yield the first ``n`` batches (all of them if None or larger) from the start."""
        total = self.num_batches if n is None or n <= 0 else min(int(n), self.num_batches)
        self.reset()
        for _ in range(total):
            yield self.next_batch()

    def __iter__(self) -> Iterator:
        return self.batches()

