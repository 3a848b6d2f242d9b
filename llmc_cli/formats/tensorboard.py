"""TensorBoard event files, written without TensorFlow or tensorboard: TFRecord framing (length, masked CRC-32C,
data, masked CRC-32C) around `Event` protocol buffers holding `Summary` scalars, encoded here by hand (the few
fields llmc writes). `tensorboard --logdir DIR` (pip install tensorboard) reads them."""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, file_version: str | None = None, scalars: dict | None = None) -> bytes:
    msg = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        msg += _field_bytes(3, file_version.encode())
    if scalars:
        summary = b"".join(_field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", v))
                           for tag, v in scalars.items())
        msg += _field_bytes(5, summary)
    return msg


def _record(data: bytes) -> bytes:
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", _masked(crc32c(head))) + data + struct.pack("<I", _masked(crc32c(data)))


# log.jsonl keys -> TensorBoard tags
TAGS = {"loss": "train/loss", "norm": "train/grad_norm", "lr": "train/lr", "tok_per_s": "train/tokens_per_s",
        "val_loss": "val/loss", "hellaswag_acc_norm": "eval/hellaswag_acc_norm", "hellaswag_acc": "eval/hellaswag_acc"}


class EventWriter:
    """One new event file in `logdir` (created); `write_record` takes what llmc logs per step."""

    def __init__(self, logdir: str | os.PathLike):
        self.dir = Path(logdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.llmc"
        self.path = self.dir / name
        self._f = open(self.path, "xb")  # a new file: never written over anything
        self._f.write(_record(_event(time.time(), 0, file_version="brain.Event:2")))
        self._f.flush()

    def write_record(self, rec: dict) -> None:
        values = {TAGS[k]: float(v) for k, v in rec.items() if k in TAGS and isinstance(v, (int, float))}
        if values and "step" in rec:
            try:
                self._f.write(_record(_event(time.time(), int(rec["step"]), scalars=values)))
                self._f.flush()
            except OSError as e:  # (a write's error names no file)
                raise OSError(e.errno, e.strerror, str(self.path)) from None

    def close(self) -> None:
        self._f.close()
