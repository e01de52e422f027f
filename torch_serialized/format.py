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
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import CorruptFileError, TruncatedFileError

__all__ = [
    "MAGIC",
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
]

#: First and last 8 bytes of every container. The high-bit byte catches 7-bit transfers,
#: CR LF catches newline translation, 0x1A stops ``type`` on DOS (as PNG does).
MAGIC = b"\x89TSER\r\n\x1a"
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
assert HEADER_SIZE == 64 and FOOTER_SIZE == 64  # noqa: S101 - import-time layout check

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
        code = _simple_code(dtype)
        return code
    out: list[list[str]] = []
    for name in dtype.names:
        sub, offset = dtype.fields[name][:2]  # type: ignore[index]
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
