"""The torch_serialized container format, version 1.1, in code; docs/FORMAT.md is the same spec in
prose (``tests/test_format.py`` checks that the two agree), down to each key and rule.

A container (``.tser`` file) holds ``N`` records of ``K`` named byte fields, named numpy arrays
of plain numbers (no object types: nothing in a file can execute code) and a strict-JSON
metadata object (``build_metadata`` lists its keys). Written front to back in one pass, read
through ``mmap``; all integers little-endian::

    offset 0            header (64 bytes)
    offset 64           record fields, each starting at a multiple of ``alignment``
    ...                 arrays (the record index first), each aligned
    meta_offset         metadata: UTF-8 JSON object, ``meta_length`` bytes
    file_size - 64      footer (64 bytes), ending with the magic again

Header (``HEADER``): ``magic``, ``major`` u16, ``minor`` u16, ``header_size`` u32 (64),
``alignment`` u32 (a power of two, 8 to ``MAX_ALIGNMENT``), ``flags`` u32 (0), 36 reserved zero
bytes, ``header_crc32`` u32 of the preceding 60 bytes. Footer (``FOOTER``): ``meta_offset``,
``meta_length``, ``file_size``, ``num_records`` (u64 each), ``meta_crc32`` u32, ``major`` u16,
``minor`` u16, 12 reserved zero bytes, ``footer_crc32`` u32 of the preceding 52 bytes, ``magic``.

Readers MUST reject a newer ``major`` and major 0 (never written), and a footer or
``format_version`` whose version differs from the header's; they MAY read a newer ``minor``
(additions only). Shard folders: ``manifest`` and docs/FORMAT.md ("Shard folders").
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

from ..errors import CorruptFileError, TruncatedFileError, UnsupportedVersionError

#: First and last 8 bytes of every container. The high-bit byte catches 7-bit transfers,
#: CR LF catches newline translation, 0x1A stops ``type`` on DOS (as PNG does).
MAGIC = b"\x89TSER\r\n\x1a"
#: The metadata's ``format`` value.
FORMAT_NAME = "torch_serialized"
FORMAT_MAJOR = 1
FORMAT_MINOR = 1
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
#: The manifest version written; readers also read version 1 (written by 0.1.0).
MANIFEST_VERSION = 2
#: Largest manifest a reader accepts (64 MiB: about 400,000 shard entries).
MAX_MANIFEST_BYTES = 64 << 20
#: Deepest nesting of JSON arrays and objects a reader accepts in metadata and manifests.
MAX_JSON_DEPTH = 64
#: Largest magnitude of an integer in metadata and manifests: 2**53 - 1. Every integer up to
#: it is exactly a double (I-JSON, RFC 7493), so a reader that parses numbers as doubles
#: (JavaScript, many C libraries) reads the value written.
MAX_JSON_INT = (1 << 53) - 1
#: A container's role in its pack (its ``pack`` metadata, see ``binding``).
ROLE_SINGLE, ROLE_SHARD, ROLE_CATALOG = "single", "shard", "catalog"
ROLES = (ROLE_SINGLE, ROLE_SHARD, ROLE_CATALOG)
PACK_ID = re.compile(r"[0-9a-f]{32}")

#: The only simple type codes a file may use: numpy's own ``dtype.str`` of little-endian
#: bool, signed and unsigned integers and IEEE floats.
_SIMPLE_CODE = re.compile(r"\|[biu]1|<[iu][248]|<f[248]")  # use fullmatch: "$" allows "\n"
MAX_FIELDS = 1024
#: Largest metadata a reader accepts.
MAX_META_BYTES = 1 << 30


def crc32(data: bytes | memoryview, value: int = 0) -> int:
    """CRC32 (zlib polynomial) of ``data``, continuing from ``value``."""
    return zlib.crc32(data, value) & 0xFFFFFFFF


def pad_to(position: int, alignment: int) -> int:
    """Bytes of zero padding that bring ``position`` to a multiple of ``alignment``."""
    return -position % alignment


#: How every message about a file that fails a check of this format ends: what to do.
DAMAGED = "the file is damaged or not a torch_serialized pack: re-copy or re-pack it"


def damaged(
    path: str, fault: str, error: type[CorruptFileError] = CorruptFileError
) -> CorruptFileError:
    """``error`` for ``path`` failing a check of this format: the file, ``fault``, what to do."""
    return error(f"{path}: {fault}; {DAMAGED}")


def pack_header(alignment: int) -> bytes:
    """The 64-byte header of a new container."""
    body = HEADER.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR, HEADER_SIZE, alignment, 0, b"", 0)
    return body[:-4] + struct.pack("<I", crc32(body[:-4]))


def unpack_header(data: bytes, path: str) -> tuple[int, int, int]:
    """Validate a header; return ``(major, minor, alignment)``."""
    if len(data) < HEADER_SIZE:
        raise damaged(path, f"{len(data)} bytes, too short for the header")
    magic, major, minor, header_size, alignment, _flags, _reserved, stored = HEADER.unpack(
        data[:HEADER_SIZE]
    )
    if magic != MAGIC:
        raise damaged(path, f"not a torch_serialized file (magic {magic!r})")
    if crc32(data[: HEADER_SIZE - 4]) != stored:
        raise damaged(path, "header checksum mismatch (header_crc32)")
    if major == 0:
        raise damaged(path, "the header's major version is 0 (never written)")
    if header_size != HEADER_SIZE:
        raise damaged(path, f"the header's header_size is {header_size}, not {HEADER_SIZE}")
    if alignment < 8 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
        raise damaged(path, f"the header's alignment {alignment} is not a power of two in 8..1 MiB")
    return major, minor, alignment


def pack_footer(
    meta_offset: int, meta_length: int, file_size: int, num_records: int, meta_crc32: int
) -> bytes:
    """The 64-byte footer that closes a container."""
    values = (meta_offset, meta_length, file_size, num_records, meta_crc32)
    body = FOOTER.pack(*values, FORMAT_MAJOR, FORMAT_MINOR, b"", 0, MAGIC)[:52]
    return body + struct.pack("<I", crc32(body)) + MAGIC


def unpack_footer(data: bytes, path: str) -> dict[str, int]:
    """Validate a footer; return its fields by name (as ``pack_footer`` names them)."""
    if len(data) != FOOTER_SIZE:
        raise damaged(path, f"{len(data)} bytes, too short for the footer", TruncatedFileError)
    *values, _reserved, stored, magic = FOOTER.unpack(data)
    if magic != MAGIC or crc32(data[:52]) != stored:
        raise damaged(path, "footer checksum mismatch (footer_crc32 or the closing magic)")
    names = ("meta_offset", "meta_length", "file_size", "num_records", "meta_crc32")
    return dict(zip((*names, "major", "minor"), values))


def dtype_to_json(dtype: np.dtype) -> str | list[list[str]]:
    """A JSON description of a simple or flat structured dtype (see ``dtype_from_json``)."""
    if dtype.names is None:
        return _simple_code(dtype)
    out = [[name, _simple_code(dtype[name])] for name in dtype.names]
    if np.dtype([(n, c) for n, c in out]) != dtype:
        raise ValueError(f"structured dtype {dtype} has padding or offsets; use a packed dtype")
    return out


def _simple_code(dtype: np.dtype) -> str:
    code = dtype.newbyteorder("<").str if dtype.byteorder == "=" else dtype.str
    if not _SIMPLE_CODE.fullmatch(code):
        raise ValueError(f"dtype {dtype} cannot be stored; use bool, int, uint or float")
    return code


def dtype_from_json(value: Any, path: str, what: str = "an array") -> np.dtype:
    """Rebuild a dtype from its JSON description (plain numbers only); ``what``: for errors."""
    if isinstance(value, str) and _SIMPLE_CODE.fullmatch(value):
        return np.dtype(value)  # every code the pattern admits is one numpy understands
    pairs = value if isinstance(value, list) else []
    if all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
        names, codes = [pair[0] for pair in pairs], [pair[1] for pair in pairs]
        if is_names(names) and all(isinstance(c, str) and _SIMPLE_CODE.fullmatch(c) for c in codes):
            return np.dtype(list(zip(names, codes)))
    raise damaged(path, f"{what} has an invalid dtype {clip(repr(value))}")


def array_bytes(array: np.ndarray) -> memoryview:
    """The bytes of ``array`` in C order as a flat view (works for zero-length axes too)."""
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
    what = f"array {clip(repr(name))}"
    keys = ("dtype", "shape", "offset", "nbytes", "crc32")
    if not isinstance(desc, Mapping) or not all(key in desc for key in keys):
        raise damaged(path, f"the descriptor of {what} is not an object with {', '.join(keys)}")
    dtype = dtype_from_json(desc["dtype"], path, what)
    dims, offset, nbytes, crc = (desc[key] for key in keys[1:])
    if not isinstance(dims, list) or not all(is_count(v) for v in (*dims, offset, nbytes, crc)):
        msg = "a shape, offset, nbytes or crc32 that is not a count"
        raise damaged(path, f"the descriptor of {what} holds {msg}")
    shape: tuple[int, ...] = tuple(dims)
    last = data_end - nbytes  # the last offset where the array still ends in the data
    if math.prod(shape) * dtype.itemsize != nbytes or not HEADER_SIZE <= offset <= last:
        msg = f"{what} ({nbytes} bytes at {offset}) does not fit its shape or the file"
        raise damaged(path, msg)
    return dtype, shape, offset, nbytes, crc


# -- strict JSON ----------------------------------------------------------------------------------
def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        keys = [key for key, _ in pairs]
        raise ValueError(f"duplicate key {clip(repr(next(k for k in keys if keys.count(k) > 1)))}")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {clip(text)} is out of range")
    return value


def _exact_int(text: str) -> int:
    """A JSON integer, refused beyond ``MAX_JSON_INT`` (which a double cannot hold exactly)."""
    if len(text.lstrip("-")) <= 16 and abs(value := int(text)) <= MAX_JSON_INT:
        return value
    raise ValueError(f"integer {clip(text, 40)} is beyond 2**53 - 1 in magnitude")


def dumps(value: Any, what: str, **options: Any) -> str:
    """``json.dumps`` refusing (``ValueError`` naming ``what``) what ``loads_json`` refuses."""
    try:
        text = json.dumps(value, allow_nan=False, **options)
        json.loads(text, parse_int=_exact_int)  # raises at the first integer out of range
    except ValueError as exc:
        raise ValueError(f"{what} cannot be stored as strict JSON: {exc}") from None
    return text


def clip(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters, for messages that quote file content."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def loads_json(data: bytes | memoryview, path: str, what: str) -> Any:
    """Parse strict JSON (RFC 8259): UTF-8, no duplicate keys (readers disagree on which
    wins), no NaN or Infinity, no integer beyond ``MAX_JSON_INT``, nesting at most
    ``MAX_JSON_DEPTH``; else ``CorruptFileError`` naming ``path`` and ``what`` it is."""
    try:
        text = bytes(data).decode("utf-8")
        value = json.loads(
            text,
            object_pairs_hook=_unique_keys,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            parse_int=_exact_int,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise damaged(path, f"{what} is not valid JSON ({clip(str(exc), 160)})") from None
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:  # no recursion: a deep structure must not exhaust the stack here either
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise damaged(path, f"{what} nests arrays or objects more than {MAX_JSON_DEPTH} deep")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


def is_count(value: Any, limit: int = 1 << 63) -> TypeGuard[int]:
    """An integer (not a bool) in ``0..limit-1``."""
    return type(value) is int and 0 <= value < limit


def is_names(value: Any, *, allow_empty: bool = False) -> TypeGuard[list[str]]:
    """A list of 1 to ``MAX_FIELDS`` distinct strings (non-empty unless ``allow_empty``)."""
    return (
        isinstance(value, list)
        and 0 < len(value) <= MAX_FIELDS
        and all(isinstance(v, str) and (v or allow_empty) for v in value)
        and len(set(value)) == len(value)
    )


# -- pack binding -----------------------------------------------------------------------------
def new_pack_id() -> str:
    """A random pack id: 32 lowercase hex digits, made once per pack (kept by appends)."""
    return secrets.token_hex(16)


def new_token() -> str:
    """A random per-write token for file names: 8 lowercase hex digits."""
    return secrets.token_hex(4)


def shard_file_name(index: int, token: str) -> str:
    """``shard-00003-<token>.tser``: the name of shard ``index`` written by write ``token``."""
    return f"shard-{index:05d}-{token}{FILE_SUFFIX}"


def catalog_file_name(token: str) -> str:
    """``catalog-<token>.tser``: the name of the catalog written by write ``token``."""
    return f"catalog-{token}{FILE_SUFFIX}"


_MEMBER_NAME = re.compile(r"(?:shard-\d{5,}-|catalog-)[0-9a-f]{8}" + re.escape(FILE_SUFFIX))


def is_member_name(name: str) -> bool:
    """Whether ``name`` is a shard or catalog name (``shard_file_name``, ``catalog_file_name``)."""
    return _MEMBER_NAME.fullmatch(name) is not None


#: The keys of a binding beside ``pack_id`` and ``role``, by role (their place in the pack).
PLACE_KEYS = {
    ROLE_SINGLE: (),
    ROLE_SHARD: ("index", "first_record", "num_records"),
    ROLE_CATALOG: ("num_records", "num_shards"),
}


def binding(role: str, pack_id: str, **place: int) -> dict[str, Any]:
    """A container's ``pack`` metadata: its pack and its place in it (``PLACE_KEYS[role]``:
    a shard's ``index`` and global records, a catalog's records and shards)."""
    return {"pack_id": pack_id, "role": role, **{key: place[key] for key in PLACE_KEYS[role]}}


def parse_binding(value: Any, path: str) -> dict[str, Any]:
    """Validate a container's ``pack`` metadata; return it (its documented keys only)."""
    if not isinstance(value, dict):
        raise damaged(path, f"the pack binding is {clip(repr(value))}, not an object")
    role, pack_id = value.get("role"), value.get("pack_id")
    if role not in ROLES:
        raise damaged(path, f"the pack binding has role {clip(repr(role))}, not one of {ROLES}")
    if not isinstance(pack_id, str) or not PACK_ID.fullmatch(pack_id):
        msg = f"the pack binding has pack_id {clip(repr(pack_id))}, not 32 hex digits"
        raise damaged(path, msg)
    for key in PLACE_KEYS[role]:
        if not is_count(value.get(key)):
            raise damaged(path, f"the pack binding ({role}) has {key} {clip(repr(value.get(key)))}")
    return binding(**value)


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
    pack: Mapping[str, Any] | None = None,
) -> bytes:
    """A container's metadata, encoded: compact UTF-8 JSON, keys in the documented order
    (``index`` and ``arrays``: ``array_descriptor``s; ``pack``: its ``binding``)."""
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
    if pack is not None:
        meta["pack"] = dict(pack)
    return dumps(meta, "the metadata", ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def parse_metadata(
    data: bytes, *, version: tuple[int, int], num_records: int, data_end: int, path: str
) -> dict[str, Any]:
    """Validate a container's metadata bytes against the header's ``version``, the footer's
    ``num_records`` and ``data_end`` (where arrays must end); return the object."""
    meta = loads_json(data, path, "metadata")
    if not isinstance(meta, dict):
        raise damaged(path, "the metadata is not a JSON object")
    found = {k: clip(repr(meta.get(k))) for k in ("format", "format_version", "arrays", "user")}
    if meta.get("format") != FORMAT_NAME:
        raise damaged(path, f"the metadata's format is {found['format']}, not {FORMAT_NAME!r}")
    version_found = meta.get("format_version")
    if version_found != list(version) or not all(type(v) is int for v in version_found):
        header = f"{version[0]}.{version[1]}"
        raise damaged(path, f"format_version is {found['format_version']}, the header's {header}")
    fields = meta.get("fields")
    if not is_names(fields, allow_empty=True):
        raise damaged(path, f"the metadata's fields are {clip(repr(fields))}, not distinct names")
    num = meta.get("num_records")
    if type(num) is not int or num != num_records:
        raise damaged(path, f"the metadata's num_records is {clip(repr(num))}, not {num_records}")
    for key in ("arrays", "user"):
        if not isinstance(meta.get(key), dict):
            raise damaged(path, f"the metadata's {key} is {found[key]}, not an object")
    dtype, shape, *_ = check_descriptor(meta.get("index"), "index", data_end, path)
    if dtype != INDEX_DTYPE or shape != (num, len(fields)):
        raise damaged(path, f"the record index has dtype {dtype} and shape {shape}")
    for name, desc in meta["arrays"].items():
        check_descriptor(desc, name, data_end, path)
        per_record, what = desc.get("per_record", False), clip(repr(name))
        if not isinstance(per_record, bool):
            raise damaged(path, f"the per_record of array {what} is not true or false")
        if per_record and desc["shape"][:1] != [num]:
            raise damaged(path, f"per-record array {what} has shape {desc['shape']}")
    if "pack" in meta:
        meta["pack"] = parse_binding(meta["pack"], path)
    return meta


# -- reading an open file -----------------------------------------------------------------------
def read_head(fd: int, size: int, path: str) -> tuple[tuple[int, int], int, dict[str, int]]:
    """Check the header and footer of the container open as ``fd`` (``size`` bytes); return
    ``((major, minor), alignment, footer)``."""
    if size < HEADER_SIZE + FOOTER_SIZE:
        raise damaged(path, f"{size} bytes, too short for a container", TruncatedFileError)
    major, minor, alignment = unpack_header(os.pread(fd, HEADER_SIZE, 0), path)
    if major > FORMAT_MAJOR:
        raise UnsupportedVersionError(
            f"{path}: format version {major}.{minor} is newer than this torch_serialized "
            f"reads ({FORMAT_MAJOR}.{FORMAT_MINOR}); upgrade torch_serialized"
        )
    tail = os.pread(fd, FOOTER_SIZE, size - FOOTER_SIZE)
    if tail[-len(MAGIC) :] != MAGIC:
        msg = "the file does not end with the footer: it was truncated or appended to"
        raise damaged(path, msg, TruncatedFileError)
    footer = unpack_footer(tail, path)
    if (footer["major"], footer["minor"]) != (major, minor):
        found = f"{footer['major']}.{footer['minor']}, its header {major}.{minor}"
        raise damaged(path, f"its footer says format version {found}")
    if footer["file_size"] != size:
        fault = "truncated" if size < footer["file_size"] else "appended to"
        msg = f"{size} bytes, its footer's file_size says {footer['file_size']}: {fault}"
        raise damaged(path, msg, TruncatedFileError)
    meta_offset, meta_length = footer["meta_offset"], footer["meta_length"]
    data_end = size - FOOTER_SIZE - meta_length  # where the metadata must start
    if meta_length > MAX_META_BYTES or not HEADER_SIZE <= meta_offset == data_end:
        msg = f"the footer's meta_offset {meta_offset} and meta_length {meta_length} are wrong"
        raise damaged(path, msg)
    return (major, minor), alignment, footer


def read_metadata(
    fd: int, version: tuple[int, int], footer: Mapping[str, int], path: str
) -> dict[str, Any]:
    """The checked metadata of the container open as ``fd``, after ``read_head``."""
    raw = os.pread(fd, footer["meta_length"], footer["meta_offset"])
    if crc32(raw) != footer["meta_crc32"]:
        raise damaged(path, "metadata checksum mismatch (the footer's meta_crc32)")
    num, end = footer["num_records"], footer["meta_offset"]
    return parse_metadata(raw, version=version, num_records=num, data_end=end, path=path)
