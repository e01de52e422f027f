"""The torch_serialized container format, version 1.0: the one place it is specified.

docs/FORMAT.md says the same in prose; ``tests/test_format.py`` checks that the two agree.

A container (``.tser`` file) holds ``N`` records of ``K`` named byte fields, named numpy
arrays and a JSON metadata object. It is written front to back in one pass and read
through ``mmap``. All integers are little-endian.

Layout::

    offset 0            header (64 bytes)
    offset 64           record fields, each starting at a multiple of ``alignment``
    ...                 arrays (the record index first), each aligned
    meta_offset         metadata: UTF-8 JSON object, ``meta_length`` bytes
    file_size - 64      footer (64 bytes), ending with the magic again

Header (``HEADER``): ``magic`` (8 bytes, ``MAGIC``), ``major`` u16, ``minor`` u16,
``header_size`` u32 (64), ``alignment`` u32 (a power of two from 8 to ``MAX_ALIGNMENT``),
``flags`` u32 (0), 36 reserved zero bytes, ``header_crc32`` u32 of the preceding 60 bytes.

Footer (``FOOTER``): ``meta_offset`` u64, ``meta_length`` u64, ``file_size`` u64,
``num_records`` u64, ``meta_crc32`` u32, ``major`` u16, ``minor`` u16, 12 reserved zero
bytes, ``footer_crc32`` u32 of the preceding 52 bytes, ``magic`` (8 bytes). A file whose
last 8 bytes are not the magic, or whose size differs from ``file_size``, is truncated.

Metadata (JSON object) keys:

- ``format``: ``"torch_serialized"``; ``format_version``: ``[major, minor]``;
- ``created_by``: the writing software (informative);
- ``num_records``: ``N``; ``fields``: the ``K`` field names in index column order;
- ``alignment``: as in the header;
- ``index``: an array descriptor for the record index, shape ``(N, K)``, dtype
  ``INDEX_DTYPE`` (offset u64, length u64, crc32 u32, reserved u32);
- ``arrays``: name -> array descriptor, plus ``per_record`` (first axis is ``N``);
- ``user``: the writer's own metadata object (schema, packing options, counts...).

An array descriptor is ``{"dtype", "shape", "offset", "nbytes", "crc32"}``. ``dtype`` is a
simple type code (exactly one of ``|b1 |i1 |u1 <i2 <i4 <i8 <u2 <u4 <u8 <f2 <f4 <f8``) or a
list of ``[name, code]`` pairs for a packed structured dtype; no object or pointer types
exist, so nothing in a file can execute code. Each record field's CRC32 is stored in the
index; ``verify`` recomputes them.

Readers MUST reject a newer ``major``; they MAY read a newer ``minor`` (additions only).

A shard set is a folder of containers plus ``MANIFEST_NAME``, a JSON object: ``format``
(``MANIFEST_FORMAT``), ``version`` (``MANIFEST_VERSION``), ``created_by``, ``num_records``,
``fields``, ``shards`` (``{"file", "num_records", "bytes", "meta_crc32"}`` each, in record
order) and ``user``.

Each structure has its writing and its reading function side by side: ``pack_header`` /
``unpack_header``, ``pack_footer`` / ``unpack_footer``, ``array_descriptor`` /
``check_descriptor``, ``build_metadata`` / ``parse_metadata``, ``build_manifest`` /
``parse_manifest``.
"""

# More than 400 lines: the whole specification in one module, docs/FORMAT.md's twin, each
# structure's writing and reading functions side by side.

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CorruptFileError, TruncatedFileError, UnsupportedVersionError

__all__ = [
    "MAGIC",
    "FORMAT_NAME",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "HEADER",
    "FOOTER",
    "HEADER_SIZE",
    "FOOTER_SIZE",
    "DEFAULT_ALIGNMENT",
    "MAX_ALIGNMENT",
    "INDEX_DTYPE",
    "FILE_SUFFIX",
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "crc32",
    "pad_to",
    "pack_header",
    "unpack_header",
    "pack_footer",
    "unpack_footer",
    "dtype_to_json",
    "dtype_from_json",
    "array_bytes",
    "array_descriptor",
    "check_descriptor",
    "build_metadata",
    "parse_metadata",
    "manifest_shard",
    "build_manifest",
    "parse_manifest",
]

#: First and last 8 bytes of every container. The high-bit byte catches 7-bit transfers,
#: CR LF catches newline translation, 0x1A stops ``type`` on DOS (as PNG does).
MAGIC = b"\x89TSER\r\n\x1a"
#: The metadata's ``format`` value.
FORMAT_NAME = "torch_serialized"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
FILE_SUFFIX = ".tser"
DEFAULT_ALIGNMENT = 64
#: Largest alignment a reader accepts (1 MiB); writers refuse larger ones.
MAX_ALIGNMENT = 1 << 20

HEADER = struct.Struct("<8sHHIII36sI")
FOOTER = struct.Struct("<QQQQIHH12sI8s")
HEADER_SIZE = HEADER.size
FOOTER_SIZE = FOOTER.size
assert HEADER_SIZE == 64 and FOOTER_SIZE == 64  # the layout tables rely on it

#: One row per (record, field): where the bytes are and their CRC32.
INDEX_DTYPE = np.dtype(
    [("offset", "<u8"), ("length", "<u8"), ("crc32", "<u4"), ("reserved", "<u4")]
)

#: A shard set is a folder holding shards and this JSON file.
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "torch_serialized.shards"
MANIFEST_VERSION = 1

#: The only simple type codes a file may use: numpy's own ``dtype.str`` of little-endian
#: bool, signed and unsigned integers and IEEE floats.
_SIMPLE_CODE = re.compile(r"\|[biu]1|<[iu][248]|<f[248]")  # use fullmatch: "$" allows "\n"
_MAX_FIELDS = 1024
#: Largest metadata a reader accepts.
MAX_META_BYTES = 1 << 30


def crc32(data: bytes | memoryview, value: int = 0) -> int:
    """CRC32 (zlib polynomial) of ``data``, continuing from ``value``."""
    return zlib.crc32(data, value) & 0xFFFFFFFF


def pad_to(position: int, alignment: int) -> int:
    """Bytes of zero padding that bring ``position`` to a multiple of ``alignment``."""
    return -position % alignment


def pack_header(alignment: int) -> bytes:
    """The 64-byte header of a new container."""
    body = HEADER.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR, HEADER_SIZE, alignment, 0, b"", 0)
    return body[:-4] + struct.pack("<I", crc32(body[:-4]))


def unpack_header(data: bytes, path: str) -> tuple[int, int, int]:
    """Validate a header; return ``(major, minor, alignment)``."""
    if len(data) < HEADER_SIZE:
        raise CorruptFileError(f"{path}: file is too short to be a torch_serialized file")
    magic, major, minor, header_size, alignment, _flags, _reserved, stored = HEADER.unpack(
        data[:HEADER_SIZE]
    )
    if magic != MAGIC:
        raise CorruptFileError(
            f"{path}: not a torch_serialized file (magic {magic!r}, expected {MAGIC!r}); "
            "pass a file written by torch_serialized.pack_voc"
        )
    if crc32(data[: HEADER_SIZE - 4]) != stored:
        raise CorruptFileError(f"{path}: header checksum mismatch; the file is damaged, re-pack it")
    if header_size != HEADER_SIZE:
        raise CorruptFileError(f"{path}: header size {header_size}, expected {HEADER_SIZE}")
    if alignment < 8 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
        raise CorruptFileError(f"{path}: invalid alignment {alignment} in header")
    return major, minor, alignment


def pack_footer(
    meta_offset: int, meta_length: int, file_size: int, num_records: int, meta_crc32: int
) -> bytes:
    """The 64-byte footer that closes a container."""
    body = FOOTER.pack(
        meta_offset,
        meta_length,
        file_size,
        num_records,
        meta_crc32,
        FORMAT_MAJOR,
        FORMAT_MINOR,
        b"",
        0,
        MAGIC,
    )
    crc = crc32(body[:52])
    return body[:52] + struct.pack("<I", crc) + MAGIC


def unpack_footer(data: bytes, path: str) -> dict[str, int]:
    """Validate a footer; return its fields by name."""
    if len(data) != FOOTER_SIZE:
        raise TruncatedFileError(
            f"{path}: {len(data)} bytes where the {FOOTER_SIZE}-byte footer should be; "
            "the file is truncated. Copy it again or re-pack it"
        )
    (
        meta_offset,
        meta_length,
        file_size,
        num_records,
        meta_crc32,
        major,
        minor,
        _reserved,
        stored,
        magic,
    ) = FOOTER.unpack(data)
    if magic != MAGIC or crc32(data[:52]) != stored:
        raise CorruptFileError(
            f"{path}: footer missing or damaged; the file is truncated or corrupted "
            "(an interrupted copy?). Copy it again or re-pack it"
        )
    return {
        "meta_offset": meta_offset,
        "meta_length": meta_length,
        "file_size": file_size,
        "num_records": num_records,
        "meta_crc32": meta_crc32,
        "major": major,
        "minor": minor,
    }


def dtype_to_json(dtype: np.dtype) -> str | list[list[str]]:
    """A JSON description of a simple or flat structured dtype (see ``dtype_from_json``)."""
    if dtype.names is None:
        return _simple_code(dtype)
    out: list[list[str]] = []
    for name in dtype.names:
        sub = dtype.fields[name][0]  # type: ignore[index]
        out.append([name, _simple_code(sub)])
    if np.dtype([(n, c) for n, c in out]) != dtype:
        raise ValueError(f"structured dtype {dtype} has padding or offsets; use a packed dtype")
    return out


def _simple_code(dtype: np.dtype) -> str:
    code = dtype.newbyteorder("<").str if dtype.byteorder == "=" else dtype.str
    if not _SIMPLE_CODE.fullmatch(code):
        raise ValueError(
            f"dtype {dtype} cannot be stored; use little-endian bool, int, uint or float"
        )
    return code


def dtype_from_json(value: Any, path: str) -> np.dtype:
    """Rebuild a dtype from its JSON description, refusing anything but plain numbers."""
    if isinstance(value, str) and _SIMPLE_CODE.fullmatch(value):
        return np.dtype(value)  # every code the pattern admits is one numpy understands
    if (
        isinstance(value, list)
        and 0 < len(value) <= _MAX_FIELDS
        and all(
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and item[0]
            and isinstance(item[1], str)
            and _SIMPLE_CODE.fullmatch(item[1])
            for item in value
        )
    ):
        try:
            return np.dtype([(name, code) for name, code in value])
        except (TypeError, ValueError) as exc:
            raise CorruptFileError(f"{path}: invalid array dtype {value!r}: {exc}") from None
    raise CorruptFileError(f"{path}: invalid array dtype {value!r} in metadata")


def array_bytes(array: np.ndarray) -> memoryview:
    """The bytes of ``array`` in C order, as a flat byte view (copied only if not contiguous).

    Unlike ``memoryview(array).cast("B")`` this also works for arrays with a zero-length axis.
    """
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def array_descriptor(array: np.ndarray, offset: int) -> dict[str, Any]:
    """Metadata entry for ``array`` stored at ``offset``."""
    return {
        "dtype": dtype_to_json(array.dtype),
        "shape": list(array.shape),
        "offset": offset,
        "nbytes": int(array.nbytes),
        "crc32": crc32(array_bytes(array)),
    }


def check_descriptor(
    desc: Any, name: str, data_end: int, path: str
) -> tuple[np.dtype, tuple[int, ...], int, int, int]:
    """Validate an array descriptor against the file; return dtype, shape, offset, nbytes, crc."""
    if not isinstance(desc, Mapping):
        raise CorruptFileError(f"{path}: array {name!r} descriptor is not an object")
    try:
        dtype = dtype_from_json(desc["dtype"], path)
        shape = tuple(desc["shape"])
        offset, nbytes, crc = desc["offset"], desc["nbytes"], desc["crc32"]
    except (KeyError, TypeError):
        raise CorruptFileError(f"{path}: array {name!r} descriptor is incomplete") from None
    ints: Sequence[Any] = (*shape, offset, nbytes, crc)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        raise CorruptFileError(f"{path}: array {name!r} descriptor has invalid numbers")
    count = 1
    for dim in shape:
        count *= dim
    if count * dtype.itemsize != nbytes or offset + nbytes > data_end or offset < HEADER_SIZE:
        raise CorruptFileError(
            f"{path}: array {name!r} ({nbytes} bytes at {offset}) does not fit its shape "
            f"{shape} or the file; the file is damaged, re-pack it"
        )
    return dtype, shape, offset, nbytes, crc


# -- metadata -----------------------------------------------------------------------------------
def build_metadata(
    *,
    created_by: str,
    num_records: int,
    fields: Sequence[str],
    alignment: int,
    index: Mapping[str, Any],
    arrays: Mapping[str, Mapping[str, Any]],
    user: Mapping[str, Any],
) -> bytes:
    """The metadata of a container, encoded: compact UTF-8 JSON, keys in the documented order.

    ``index`` and ``arrays`` are descriptors made by ``array_descriptor`` (arrays with their
    ``per_record`` flag); ``user`` is the writer's own JSON object.
    """
    meta = {
        "format": FORMAT_NAME,
        "format_version": [FORMAT_MAJOR, FORMAT_MINOR],
        "created_by": created_by,
        "num_records": num_records,
        "fields": list(fields),
        "alignment": alignment,
        "index": dict(index),
        "arrays": {name: dict(desc) for name, desc in arrays.items()},
        "user": dict(user),
    }
    text = json.dumps(meta, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8")


def parse_metadata(data: bytes, *, num_records: int, data_end: int, path: str) -> dict[str, Any]:
    """Validate a container's metadata bytes; return the object.

    ``num_records`` is the footer's count and ``data_end`` the metadata's offset, the end of
    the space arrays may occupy. Raises ``CorruptFileError`` for anything but metadata that
    describes a container with those records, a valid index descriptor and valid arrays.
    """
    try:
        meta = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptFileError(f"{path}: metadata is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise CorruptFileError(f"{path}: metadata is not a JSON object")
    fields = meta.get("fields")
    num = meta.get("num_records")
    if (
        meta.get("format") != FORMAT_NAME
        or not isinstance(fields, list)
        or not fields
        or not all(isinstance(f, str) for f in fields)
        or type(num) is not int
        or num != num_records
    ):
        raise CorruptFileError(f"{path}: metadata does not describe a torch_serialized file")
    arrays = meta.get("arrays")
    user = meta.get("user")
    if not isinstance(arrays, dict) or not isinstance(user, dict):
        raise CorruptFileError(f"{path}: metadata lacks its arrays or user sections")
    dtype, shape, *_ = check_descriptor(meta.get("index"), "index", data_end, path)
    if dtype != INDEX_DTYPE or shape != (num, len(fields)):
        raise CorruptFileError(f"{path}: record index has dtype {dtype}, shape {shape}")
    for name, desc in arrays.items():
        check_descriptor(desc, name, data_end, path)
        if desc.get("per_record") and desc["shape"][:1] != [num]:
            raise CorruptFileError(f"{path}: per-record array {name!r} has the wrong length")
    return meta


# -- shard manifest -----------------------------------------------------------------------------
def manifest_shard(file: str, num_records: int, nbytes: int, meta_crc32: int) -> dict[str, Any]:
    """One entry of a manifest's ``shards`` list."""
    return {"file": file, "num_records": num_records, "bytes": nbytes, "meta_crc32": meta_crc32}


def build_manifest(
    *,
    created_by: str,
    num_records: int,
    fields: Sequence[str],
    shards: Sequence[Mapping[str, Any]],
    user: Mapping[str, Any],
) -> bytes:
    """The manifest of a shard set, encoded: indented UTF-8 JSON ending with a newline.

    ``shards`` are ``manifest_shard`` entries in record order.
    """
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "created_by": created_by,
        "num_records": num_records,
        "fields": list(fields),
        "shards": [dict(shard) for shard in shards],
        "user": dict(user),
    }
    return (json.dumps(manifest, indent=1, ensure_ascii=False, allow_nan=False) + "\n").encode()


def parse_manifest(data: bytes, path: str) -> dict[str, Any]:
    """Validate a manifest's bytes; return the object.

    Raises ``UnsupportedVersionError`` for a newer manifest version and ``CorruptFileError``
    for anything else that is not a manifest listing at least one shard by a plain file name.
    """
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptFileError(f"{path}: not valid JSON ({exc}); re-pack the dataset") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CorruptFileError(f"{path}: not a torch_serialized shard manifest")
    version = manifest.get("version")
    if not isinstance(version, int) or version > MANIFEST_VERSION:
        raise UnsupportedVersionError(
            f"{path}: manifest version {version!r} is newer than this torch_serialized reads "
            f"({MANIFEST_VERSION}); upgrade torch_serialized"
        )
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards or not isinstance(manifest.get("user"), dict):
        raise CorruptFileError(f"{path}: manifest lists no shards")
    for entry in shards:
        name = entry.get("file") if isinstance(entry, dict) else None
        if (
            not isinstance(name, str)
            or Path(name).name != name
            or name in ("", ".", "..")
            or not isinstance(entry.get("num_records"), int)
            or not isinstance(entry.get("meta_crc32"), int)
        ):
            raise CorruptFileError(f"{path}: invalid shard entry {entry!r}")
    return manifest
