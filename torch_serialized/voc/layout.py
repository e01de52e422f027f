"""Where a VOCdevkit lives on disk and which ids its ImageSets lists name, read as torchvision
reads them; lines that cannot name a file are refused."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

from ..container.fileio import (
    DEFAULT_MAX_FILE_BYTES,
    FileKindError,
    FileSizeError,
    read_regular_file,
)
from ..container.spec import FILE_SUFFIX, MANIFEST_NAME
from ..errors import SourceDataError, SourceNotFoundError
from ..remote.store import is_url

#: The ImageSets sub-folders torchvision reads, in the order a pack lays out their ids.
TASKS: tuple[str, ...] = ("Main", "Segmentation")
#: The list names torchvision accepts as ``image_set`` (``test`` only for 2007).
STANDARD_IMAGE_SETS: tuple[str, ...] = ("train", "val", "trainval", "test")

_VOC_FOLDER = re.compile(r"VOC(\d{4})")
_YEAR = re.compile(r"\d{4}")


def base_dir(year: str) -> str:
    """The folder torchvision expects under ``root``; 2011's archive unpacks under ``TrainVal/``."""
    if year == "2011":
        return os.path.join("TrainVal", "VOCdevkit", "VOC2011")
    return os.path.join("VOCdevkit", f"VOC{year}")


def find_voc_root(root: str | os.PathLike[str], year: str | None) -> tuple[Path, str]:
    """``(voc_root, year)`` from torchvision's ``root`` or the ``VOC{year}`` folder itself;
    ``year=None``: the only ``VOC<year>`` folder there (several: an error naming them)."""
    root = Path(root)
    if year is not None:
        _check_year(year)
    if not root.is_dir():
        error = SourceDataError if os.path.lexists(root) else SourceNotFoundError
        raise error(f"VOC root {str(root)!r} is not a directory; pass an existing folder.")
    found = _found(root)
    listed = ", ".join(repr(str(path)) for path in found)
    years = " or ".join(repr(path.name[3:]) for path in found)
    if year is None:
        if len(found) == 1:
            return found[0], found[0].name[3:]
        if found:
            raise SourceDataError(
                f"{str(root)!r} holds several VOC folders ({listed}); pick one with year= "
                f"({years}; --year on the command line)."
            )
        raise SourceNotFoundError(
            f"No Pascal VOC folder found under {str(root)!r}: looked for VOCdevkit/VOC<year>, "
            "TrainVal/VOCdevkit/VOC<year> and VOC<year>. Pass torchvision's root or VOC<year>."
        )
    candidates = _candidates(root, year)
    for candidate in candidates:
        if candidate.is_dir():
            return candidate, year
    looked = ", ".join(repr(str(c)) for c in candidates)
    advice = f"Pass torchvision's root (holding VOCdevkit/VOC{year}) or the VOC{year} folder."
    if found:
        names = ", ".join(path.name for path in found)
        advice = f"Found {names} ({listed}): pass year={years} (--year on the command line)."
    raise SourceNotFoundError(f"No Pascal VOC {year} folder found: looked for {looked}. {advice}")


def find_source(root: str | os.PathLike[str], year: str | None) -> tuple[Path, str]:
    """``find_voc_root``, its error saying so when ``root`` is a pack or URL, not a VOC source."""
    if is_url(root):  # as typed: a Path would make https://host/x https:/host/x
        raise SourceDataError(
            f"{root} is a URL: packing reads a local VOC folder (torchvision's root); download "
            "it first and pack that (OUTPUT may be a URL)"
        )
    try:
        return find_voc_root(root, year)
    except SourceDataError as exc:
        path = Path(root)
        if path.suffix == FILE_SUFFIX or (path / MANIFEST_NAME).is_file():
            what = "a shard folder" if path.is_dir() else f"a {FILE_SUFFIX} file"
            raise type(exc)(
                f"{root} is a pack ({what}), not a VOC root: read it with VOCSerializedDataset, "
                "or pack the folder holding VOCdevkit/"
            ) from None
        raise


def _check_year(year: object) -> None:
    """Refuse a ``year`` that is not a 4-digit ``str`` (torchvision refuses a non-str)."""
    if isinstance(year, str):
        if not _YEAR.fullmatch(year):
            raise SourceDataError(f"year must be 4 digits such as '2007', got {year!r}.")
        return
    text = year.decode("ascii", "replace") if isinstance(year, bytes) else str(year)
    text = text.removesuffix(".0")
    hint = f": pass year={text!r}" if _YEAR.fullmatch(text) else ""
    raise SourceDataError(
        f"year must be a string such as '2007', got {type(year).__name__} {year!r}{hint}."
    )


def _candidates(root: Path, year: str) -> list[Path]:
    """Folders that may be ``VOC{year}``, torchvision's own choice first."""
    devkit = [root / "VOCdevkit" / f"VOC{year}", root / "TrainVal" / "VOCdevkit" / f"VOC{year}"]
    candidates = sorted(devkit, key=lambda path: path != root / base_dir(year))
    if root.name == f"VOC{year}":
        candidates.append(root)
    if root.name == "VOCdevkit":
        candidates.append(root / f"VOC{year}")
    return candidates


def _found(root: Path) -> list[Path]:
    """Sorted ``VOC<year>`` folders under ``root/VOCdevkit``, ``root/TrainVal/VOCdevkit``,
    else ``root`` as a ``VOCdevkit``, else ``root`` itself if one."""
    found = _voc_folders(root / "VOCdevkit", root / "TrainVal" / "VOCdevkit")
    if not found and root.name == "VOCdevkit":
        found = _voc_folders(root)
    if not found and _VOC_FOLDER.fullmatch(root.name):  # the caller checked it is a folder
        found = [root]
    return found


def _voc_folders(*parents: Path) -> list[Path]:
    found = (p for parent in parents for p in parent.glob("VOC*"))
    return sorted(p for p in found if _VOC_FOLDER.fullmatch(p.name) and p.is_dir())


def read_image_sets(
    voc_root: Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> dict[str, dict[str, list[str]]]:
    """Task -> list name -> ids, as torchvision reads them (file order, duplicates kept).
    Every ``*.txt`` but a per-class file (``aeroplane_train.txt``) is a list."""
    voc_root = Path(voc_root)
    image_sets = voc_root / "ImageSets"
    if not image_sets.is_dir():
        raise SourceNotFoundError(
            f"{str(image_sets)!r} does not exist. Create ImageSets/Main/train.txt (and val.txt, "
            "...) with one image id per line, e.g. 000005 for JPEGImages/000005.jpg."
        )
    folders = [image_sets / task for task in TASKS]
    found = {f.name: _read_task(f, max_file_bytes) for f in folders if f.is_dir()}
    result = {task: lists for task, lists in found.items() if lists}
    if not result:
        raise SourceNotFoundError(
            f"No list files in {str(image_sets)!r}: expected Main/train.txt, Main/val.txt, ... "
            "(or Segmentation/...). Create them with one image id per line."
        )
    return result


def _read_task(folder: Path, max_file_bytes: int) -> dict[str, list[str]]:
    """One ImageSets sub-folder's id lists, standard names first, then custom ones sorted."""
    paths = {path.stem: path for path in folder.glob("*.txt") if not path.is_dir()}
    standard = [name for name in STANDARD_IMAGE_SETS if name in paths]
    lists: dict[str, list[str]] = {}
    for name in standard + sorted(set(paths) - set(standard)):
        try:
            text = read_list_file(paths[name], max_file_bytes).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SourceDataError(
                f"{paths[name]}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as "
                "UTF-8."
            ) from None
        # torchvision's [x.strip() for x in open(path).readlines()] (universal newlines)
        lines = [line.strip() for line in io.StringIO(text, newline=None).readlines()]
        if name in standard or not _per_class(lines):  # "000005 -1": a per-class file
            lists[name] = _ids(paths[name], lines)
    return lists


def _per_class(lines: list[str]) -> bool:
    """Whether every non-blank line is an id and -1, 0 or 1 (``aeroplane_train.txt``)."""
    rows = [line.split() for line in lines if line]
    return bool(rows) and all(len(row) == 2 and row[1] in ("-1", "0", "1") for row in rows)


def _ids(path: Path, lines: list[str]) -> list[str]:
    """A list's stripped lines, checked to be ids."""
    if lines and lines[0].startswith("\ufeff"):
        raise SourceDataError(f"{path}, line 1: starts with a byte order mark; save it without")
    for number, line in enumerate(lines, start=1):
        if not line:
            raise SourceDataError(
                f"{path}, line {number}: blank line (torchvision reads an empty id); delete it."
            )
        if "/" in line or "\\" in line or "\0" in line or line in (".", ".."):
            raise SourceDataError(
                f"{path}, line {number}: id {line!r} is a path, not a file name; use plain ids."
            )
    return lines


def image_set_files(voc_root: Path, max_file_bytes: int) -> Iterator[tuple[str, bytes]]:
    """Every ImageSets list file as ``(devkit-relative path, bytes)``, sorted, for export."""
    base = voc_root / "ImageSets"
    for path in sorted(base.rglob("*.txt")):
        if not path.is_dir():
            yield path.relative_to(voc_root).as_posix(), read_list_file(path, max_file_bytes)


def read_list_file(path: Path, max_file_bytes: int) -> bytes:
    """An ImageSets list file's bytes (``SourceDataError`` if unreadable)."""
    try:
        return read_regular_file(path, max_file_bytes, "the list file")
    except (FileKindError, FileSizeError) as exc:
        raise SourceDataError(f"{exc}; replace it with a plain text file of ids") from None
    except OSError as exc:
        raise SourceDataError(f"{path}: cannot read the list file: {exc.strerror or exc}") from None


_NEAR_MISSES: Final[Mapping[str, tuple[str, ...]]] = {  #: spellings torchvision won't read
    ".jpg": (".JPG", ".jpeg", ".JPEG", ".Jpg", ".png", ".PNG"),
    ".xml": (".XML",),
    ".png": (".PNG",),
}


def near_miss(path: str) -> str | None:
    """A file beside the missing ``path`` with another spelling of its extension, if any."""
    stem, ext = os.path.splitext(path)
    for other in _NEAR_MISSES.get(ext, ()):
        if os.path.isfile(stem + other):
            return stem + other
    return None
