"""VOC annotation XML -> the exact dict torchvision's ``VOCDetection`` returns, by its own expat
ElementTree and ``parse_voc_xml`` rules, but refusing documents that declare entities (XML bombs)
or name an external DTD or entity."""

from __future__ import annotations

import pyexpat
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ..errors import SourceDataError

__all__ = ["VOCObjects", "parse_annotation", "extract_objects"]

_NAMESPACE_SEPARATOR = "}"  # ElementTree's, so the pre-pass parses as it does
_COORDINATES = ("xmin", "ymin", "xmax", "ymax")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Entities and external DTDs live only in <!DOCTYPE>: a document without it skips the pre-pass.
_DOCTYPE_MARKERS = (b"DOCTYPE", "DOCTYPE".encode("utf-16-le")[:-1])


class _Unsafe(Exception):
    """Stops the expat pre-pass at the first unsafe construct."""


def parse_annotation(data: bytes, *, source: str) -> dict[str, Any]:
    """An annotation as torchvision's dict; ``SourceDataError`` for malformed or unsafe XML."""
    if any(marker in data for marker in _DOCTYPE_MARKERS):
        _check_safe(data, source)
    try:
        root = ET.XML(data)
    except ET.ParseError as exc:
        line, column = exc.position
        _malformed(source, line, column, pyexpat.ErrorString(exc.code))
    except (LookupError, ValueError) as exc:  # raised by expat's unknown-encoding callback
        _unsupported_encoding(source, exc)
    if not len(root):
        return {root.tag: root.text.strip()} if root.text else {}
    try:
        return {root.tag: _convert(root)}
    except RecursionError:
        raise SourceDataError(
            f"{source}: elements are nested too deeply to convert (as in torchvision); flatten it."
        ) from None


def _check_safe(data: bytes, source: str) -> None:
    """One expat pass without a tree, refusing entity declarations (bombs stop before any
    expansion) and external DTDs or entities (never fetched)."""
    parser = pyexpat.ParserCreate(None, _NAMESPACE_SEPARATOR)

    def refuse(what: str) -> Callable[..., NoReturn]:
        def handler(name: object = None, *_args: object) -> NoReturn:
            raise _Unsafe(what.format(name))

        return handler

    def check_doctype(_name: str, system_id: str | None, public_id: str | None, _: bool) -> None:
        if system_id or public_id:
            raise _Unsafe(f"references the external DTD {system_id or public_id!r}")

    parser.EntityDeclHandler = parser.UnparsedEntityDeclHandler = refuse("declares the entity {!r}")
    parser.ExternalEntityRefHandler = refuse("references an external entity")
    parser.SkippedEntityHandler = refuse("references the undeclared entity {!r}")
    parser.StartDoctypeDeclHandler = check_doctype
    try:
        parser.Parse(data, True)
    except _Unsafe as exc:
        raise SourceDataError(
            f"{source}: refusing unsafe XML that {exc} (line {parser.CurrentLineNumber}); "
            "VOC annotations never need a DTD or entities: remove the <!DOCTYPE ...> block."
        ) from None
    except pyexpat.ExpatError as exc:
        _malformed(source, exc.lineno, exc.offset, pyexpat.ErrorString(exc.code))
    except (LookupError, ValueError) as exc:
        _unsupported_encoding(source, exc)


def _malformed(source: str, line: int, column: int, reason: str) -> NoReturn:
    """Raise the malformed-XML error; ``column`` is expat's 0-based offset, shown 1-based."""
    raise SourceDataError(
        f"{source}: malformed XML at line {line}, column {column + 1}: {reason}. "
        "Fix the file or re-export the annotation."
    ) from None


def _unsupported_encoding(source: str, exc: Exception) -> NoReturn:
    """Raise for an encoding expat cannot read (torchvision fails too)."""
    raise SourceDataError(
        f"{source}: the encoding named in the XML declaration is not supported ({exc}); "
        "re-save the file as UTF-8."
    ) from None


def _convert(node: ET.Element) -> dict[str, Any]:
    """``parse_voc_xml``'s dict for a parent ``node``: leaves give their stripped text (none if
    empty), repeated children a list, ``annotation`` always an ``object`` list."""
    grouped: dict[str, list[Any]] = {}
    for child in node:
        if len(child):
            value: Any = _convert(child)
        else:
            text = child.text
            if not text:
                continue
            value = text.strip()
        grouped.setdefault(child.tag, []).append(value)
    if node.tag == "annotation":
        grouped["object"] = [grouped.get("object", [])]
    return {tag: values[0] if len(values) == 1 else values for tag, values in grouped.items()}


@dataclass(frozen=True, eq=False)
class VOCObjects:
    """One annotation's objects in document order: float32 ``boxes`` ``(n, 4)`` as written,
    uint8 ``difficult`` and ``truncated`` (0 when absent)."""

    boxes: np.ndarray
    names: list[str]
    difficult: np.ndarray
    truncated: np.ndarray


def extract_objects(target: dict[str, Any], *, source: str) -> VOCObjects:
    """Boxes, names and flags of a target; ``SourceDataError`` for an object rows cannot hold."""
    annotation = target.get("annotation")
    if not isinstance(annotation, dict):
        raise SourceDataError(
            f"{source}: the root element is not a non-empty <annotation>; fix the file."
        )
    objects = annotation["object"]
    count = len(objects)
    boxes = np.zeros((count, 4), dtype=np.float32)
    names: list[str] = []
    difficult = np.zeros(count, dtype=np.uint8)
    truncated = np.zeros(count, dtype=np.uint8)
    for index, obj in enumerate(objects):
        where = f"{source}: object {index}"
        if not isinstance(obj, dict):
            raise SourceDataError(f"{where} has no child elements; give it <name> and <bndbox>.")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise SourceDataError(f"{where} has no single non-empty <name>; add the class name.")
        names.append(name)
        boxes[index] = _box(obj.get("bndbox"), where)
        difficult[index] = _flag(obj, "difficult", where)
        truncated[index] = _flag(obj, "truncated", where)
    return VOCObjects(boxes=boxes, names=names, difficult=difficult, truncated=truncated)


def _box(bndbox: Any, where: str) -> list[float]:
    """``[xmin, ymin, xmax, ymax]`` from a ``bndbox`` dict, whatever its child order."""
    if not isinstance(bndbox, dict):
        raise SourceDataError(
            f"{where} has no single <bndbox> with <xmin>, <ymin>, <xmax>, <ymax>; add one."
        )
    coordinates = []
    for key in _COORDINATES:
        text = bndbox.get(key)
        try:
            value = float(text)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            value = float("nan")
        if not abs(value) <= _FLOAT32_MAX:  # nan, inf, or inf once stored as float32
            raise SourceDataError(
                f"{where}: <bndbox><{key}> is {text!r}, not a finite float32 number; "
                "write the pixel coordinate as a number."
            )
        coordinates.append(value)
    return coordinates


def _flag(obj: dict[str, Any], key: str, where: str) -> int:
    """A 0/1 flag such as ``difficult``; missing or empty is 0."""
    text = obj.get(key, "")
    if text == "":
        return 0
    if text in ("0", "1"):
        return int(text)
    raise SourceDataError(f"{where}: <{key}> is {text!r}; write 0 or 1.")
