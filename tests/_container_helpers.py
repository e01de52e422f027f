"""Container helpers shared by the writer, reader, parallel and atomic tests.

Record contents are derived from their indices (``payload(i, k, size)``), so every read checks
itself; ``write_pack`` writes such records, ``parse_container`` is an independent reader written
from docs/FORMAT.md. spawn and forkserver workers unpickle objects by importing their module,
so the Dataset wrapper and the functions run in other processes live here, at module level.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _reliability_helpers import PACK_ID, TOKEN, pinned_identity  # noqa: F401 (re-exported)
from torch.utils.data import Dataset

from torch_serialized.container import manifest as mf
from torch_serialized.container import spec as fmt
from torch_serialized.container.shards import PackReader
from torch_serialized.container.shardwriter import PackWriter
from torch_serialized.errors import TorchSerializedError

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["image", "target"]
COLUMNS = np.dtype([("id", "<u4"), ("w", "<f4")])
SHARDED = {"max_records_per_shard": 7}
#: PackWriter limits of the two pack forms.
FORMS = {"single": {}, "shards": SHARDED}
ignore_fork_warning = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning",
    "ignore:This DataLoader will create:UserWarning",
)


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


def write_pack(
    out: Path, n: int, *, seed: int = 0, user: dict[str, Any] | None = None, **limits: Any
) -> Path:
    """A pack of ``n`` self-describing records (content shifted by ``seed``)."""
    with PackWriter(out, FIELDS, columns=COLUMNS, **limits) as w:
        for i in range(n):
            j = i + seed
            w.add([payload(j, k, size_of(j, k)) for k in range(len(FIELDS))], (j, j / 2))
        w.add_array("classes", np.arange(5, dtype="<i8"))
        w.close({"seed": seed} if user is None else user)
    return out


def check_pack(reader: PackReader, n: int, seed: int = 0) -> None:
    assert len(reader) == n and reader.fields == FIELDS
    for i in range(n):
        for k in range(len(FIELDS)):
            assert bytes(reader.field(i, k)) == payload(i + seed, k, size_of(i + seed, k))


def container_files(path: Path) -> list[Path]:
    """The shard files of a pack in record order (the file itself for a single file)."""
    if path.is_dir():
        manifest = json.loads((path / fmt.MANIFEST_NAME).read_text())
        return [path / s["file"] for s in manifest["shards"]]
    return [path]


def catalog_file(path: Path) -> Path:
    """The catalog of a version-2 shard folder."""
    manifest = json.loads((path / fmt.MANIFEST_NAME).read_text())
    return path / manifest["catalog"]["file"]


def edit_manifest(
    path: Path, edit: Callable[[dict[str, Any]], Any], *, checksum: bool = True
) -> None:
    """Rewrite the manifest of the shard folder ``path`` as ``edit`` returns it (a dict, or
    text written as is); with ``checksum``, a dict gets a valid checksum, so the edit reaches
    the checks behind the manifest's own."""
    manifest_path = path / fmt.MANIFEST_NAME
    edited = edit(json.loads(manifest_path.read_text()))
    if isinstance(edited, dict) and checksum and "checksum" in edited:
        edited["checksum"] = mf.manifest_checksum(edited)
    manifest_path.write_text(edited if isinstance(edited, str) else json.dumps(edited, indent=1))


def record_spans(path: Path) -> list[tuple[int, Path, int, int]]:
    """(global record, file, offset, length) of every non-empty field, by the spec."""
    spans, start = [], 0
    for file in container_files(path):
        meta, index = parse_container(file)
        for i in range(index.shape[0]):
            for k in range(index.shape[1]):
                if index[i, k]["length"]:
                    spans.append(
                        (start + i, file, int(index[i, k]["offset"]), int(index[i, k]["length"]))
                    )
        start += meta["num_records"]
    return spans


def flip(file: Path, position: int) -> None:
    with open(file, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x5A]))


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def copy_pack(src: Path, dst_folder: Path) -> Path:
    dst = dst_folder / src.name
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    return dst


def assert_bad_content(exc: BaseException, path: Path) -> None:
    """``exc`` says the file at ``path`` has bad content (our ``ValueError``) and names it."""
    assert isinstance(exc, ValueError) and isinstance(exc, TorchSerializedError)
    assert str(path) in str(exc)


def no_pack_output(folder: Path) -> None:
    """Nothing named like the output (``out*``), nor its temporaries (``.out*``), is left."""
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith((".out", "out"))]
    assert leftovers == []


# Child scripts import writer and errors without the package __init__ (which imports torch):
# faster, and it checks that the writer never imports torch.
PRELUDE = f"""
import sys, types
package = types.ModuleType("torch_serialized")
package.__path__ = [{str(ROOT / "torch_serialized")!r}]
sys.modules["torch_serialized"] = package
from torch_serialized.container.shardwriter import PackWriter
from torch_serialized.errors import WriteError
assert "torch" not in sys.modules, "the writer imported torch"
"""


def run_python(code: str, *args: str, **kwargs: Any) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


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


def rewrite_container(
    path: Path,
    *,
    header_version: tuple[int, int] | None = None,
    footer_version: tuple[int, int] | None = None,
    meta: Callable[[dict[str, Any]], Any] | None = None,
) -> None:
    """Rewrite a container's header version, footer version or metadata, every CRC valid."""
    data = bytearray(path.read_bytes())
    if header_version is not None:
        struct.pack_into("<HH", data, 8, *header_version)
        struct.pack_into("<I", data, 60, fmt.crc32(bytes(data[:60])))
    offset, length, _size, num, _crc, major, minor = struct.unpack_from(
        "<QQQQIHH", data, len(data) - 64
    )
    raw = bytes(data[offset : offset + length])
    if meta is not None:
        value = json.loads(raw)
        meta(value)
        raw = json.dumps(value, separators=(",", ":")).encode()
    if footer_version is not None:
        major, minor = footer_version
    body = bytes(data[:offset]) + raw
    footer = struct.pack(
        "<QQQQIHH12x", offset, len(raw), len(body) + 64, num, fmt.crc32(raw), major, minor
    )
    path.write_bytes(body + footer + struct.pack("<I", fmt.crc32(footer)) + fmt.MAGIC)


# -- hostile packs with valid checksums -------------------------------------------------------
@dataclass
class Contents:
    """Everything a pack holds, editable: what ``rebuild_pack`` writes back."""

    fields: list[str]
    records: list[list[bytes]]
    arrays: dict[str, np.ndarray]
    user: dict[str, Any]


def read_contents(path: Path) -> Contents:
    reader = PackReader(path)
    records = [
        [bytes(reader.field(i, k)) for k in range(len(reader.fields))] for i in range(len(reader))
    ]
    arrays = {name: np.array(array) for name, array in reader.arrays().items()}
    return Contents(list(reader.fields), records, arrays, copy.deepcopy(reader.user))


def write_contents(contents: Contents, out: Path, **limits: Any) -> Path:
    """Write ``contents`` as a new pack at ``out``: every checksum, size and binding valid,
    whatever the contents say, so they reach the checks behind the checksums."""
    arrays = dict(contents.arrays)
    rows = arrays.pop("records", None)
    columns = None if rows is None else rows.dtype
    with PackWriter(out, contents.fields, columns=columns, **limits) as writer:
        for i, record in enumerate(contents.records):
            writer.add(record, None if rows is None else rows[i])
        for name, array in arrays.items():
            writer.add_array(name, array)
        writer.close(contents.user)
    return out


def rebuild_pack(
    src: Path, out: Path, edit: Callable[[Contents], Any] | None = None, **limits: Any
) -> Path:
    """The pack at ``src`` written again at ``out`` after ``edit`` changed its contents."""
    contents = read_contents(src)
    if edit is not None:
        edit(contents)
    return write_contents(contents, out, **limits)
