"""Helpers for tests/test_container.py that child processes must be able to import.

spawn and forkserver workers unpickle objects by importing their module, so the Dataset
wrapper and the functions run in other processes live here, at module level.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from torch_serialized.reader import PackReader


def payload(i: int, k: int, size: int) -> bytes:
    """Bytes of field ``k`` of record ``i``: derived from the indices, so a read checks itself."""
    seed = hashlib.blake2b(f"{i}/{k}".encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


def size_of(i: int, k: int) -> int:
    """A spread of field sizes: empty, tiny, around the alignment, a few KiB."""
    return (0, 1, 63, 64, 65, 200, 3000)[(i * 7 + k * 3) % 7]


class FieldBytes(Dataset):
    """Map-style dataset over readers: item ``i`` is ``(pid, mapped_here, bytes per field)``."""

    def __init__(self, readers: list[PackReader]) -> None:
        self.readers = readers

    def __len__(self) -> int:
        return len(self.readers[0])

    def __getitem__(self, i: int) -> tuple[int, bool, list[list[bytes]]]:
        data = [[bytes(r.field(i, k)) for k in range(len(r.fields))] for r in self.readers]
        # the shard that served the read is mapped by this process, not inherited
        mapped_here = all(r.locate(i)[0].mapped_by == os.getpid() for r in self.readers)
        return os.getpid(), mapped_here, data


def read_all_pickled(blob: bytes) -> tuple[int, list[list[bytes]], dict[str, Any]]:
    """Unpickle a reader in this process and read every field of every record."""
    reader: PackReader = pickle.loads(blob)
    data = [
        [bytes(reader.field(i, k)) for k in range(len(reader.fields))] for i in range(len(reader))
    ]
    arrays = {name: a.tobytes() for name, a in reader.arrays().items()}
    return os.getpid(), data, arrays


def pack_file_bytes(path: Path) -> dict[str, bytes]:
    """Every byte of a pack: ``{"": bytes}`` for one file, file name -> bytes for a folder."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def read_error(reader: PackReader, conn: Any) -> None:
    """Read record 0 in this (forked) process; send back the exception, or None."""
    try:
        reader.field(0, 0)
    except BaseException as exc:  # the test inspects it
        conn.send((type(exc).__name__, isinstance(exc, OSError), str(exc)))
    else:
        conn.send(None)
    conn.close()


# -- an independent reader, written from docs/FORMAT.md with struct, json and numpy only ---
def parse_container(path: str | os.PathLike[str]) -> tuple[dict[str, Any], np.ndarray]:
    """(metadata, index) of a container, validated the way FORMAT.md says, without our code."""
    data = Path(path).read_bytes()
    magic = b"\x89TSER\r\n\x1a"
    if len(data) < 128 or data[:8] != magic or data[-8:] != magic:
        raise ValueError("not a complete container")
    header_crc = struct.unpack_from("<I", data, 60)[0]
    if zlib.crc32(data[:60]) != header_crc:
        raise ValueError("header crc")
    footer = data[-64:]
    meta_offset, meta_length, file_size, num_records, meta_crc = struct.unpack_from(
        "<QQQQI", footer
    )
    if zlib.crc32(footer[:52]) != struct.unpack_from("<I", footer, 52)[0]:
        raise ValueError("footer crc")
    if file_size != len(data) or meta_offset + meta_length != file_size - 64:
        raise ValueError("sizes")
    raw = data[meta_offset : meta_offset + meta_length]
    if zlib.crc32(raw) != meta_crc:
        raise ValueError("meta crc")
    meta = json.loads(raw)
    desc = meta["index"]
    dtype = np.dtype([(name, code) for name, code in desc["dtype"]])
    blob = data[desc["offset"] : desc["offset"] + desc["nbytes"]]
    if zlib.crc32(blob) != desc["crc32"]:
        raise ValueError("index crc")
    index = np.frombuffer(blob, dtype).reshape(desc["shape"])
    if index.shape != (num_records, len(meta["fields"])):
        raise ValueError("index shape")
    return meta, index
