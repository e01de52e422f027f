"""Where a VOCdevkit lives on disk and which ids its ImageSets lists name.

torchvision joins ``root`` with ``base_dir(year)`` (``VOCdevkit/VOC{year}``, but
``TrainVal/VOCdevkit/VOC2011`` for 2011) and reads ``ImageSets/{Main,Segmentation}/
{image_set}.txt`` as ``[x.strip() for x in f.readlines()]``. :func:`find_voc_root` accepts that
root or the ``VOC{year}`` folder itself; :func:`read_image_sets` returns the very id lists
torchvision would build, and refuses the lines that would make torchvision look for a nameless
``JPEGImages/.jpg``; :func:`image_set_files` returns the list files' bytes.
"""

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
from ..errors import SourceDataError, SourceNotFoundError

#: The ImageSets sub-folders torchvision reads: ``Main`` for detection, ``Segmentation`` for masks;
#: also the order in which a pack lays out their ids.
TASKS: tuple[str, ...] = ("Main", "Segmentation")
#: The list names torchvision accepts as ``image_set`` (``test`` only for 2007).
STANDARD_IMAGE_SETS: tuple[str, ...] = ("train", "val", "trainval", "test")

_VOC_FOLDER = re.compile(r"VOC(\d{4})")
_YEAR = re.compile(r"\d{4}")


def base_dir(year: str) -> str:
    """The folder torchvision expects under its ``root`` for ``year``: ``VOCdevkit/VOC{year}``,
    except 2011, whose archive unpacks under ``TrainVal/``."""
    if year == "2011":
        return os.path.join("TrainVal", "VOCdevkit", "VOC2011")
    return os.path.join("VOCdevkit", f"VOC{year}")


def find_voc_root(root: str | os.PathLike[str], year: str | None) -> tuple[Path, str]:
    """Locate ``VOCdevkit/VOC{year}`` from torchvision's ``root`` or the folder itself.

    With ``year=None`` the year comes from the folder name (``VOC2007`` -> ``"2007"``) or from the
    only ``VOC20xx`` folder under ``root``; several are an error that names them. This is the
    one year rule of ``pack_voc``, the command line, the benchmark and the examples. Returns
    ``(voc_root, year)``.
    """
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
            "TrainVal/VOCdevkit/VOC<year> and a folder named VOC<year>. Pass torchvision's root "
            "(the folder holding VOCdevkit/VOC2012) or the VOC2012 folder itself."
        )
    candidates = _candidates(root, year)
    for candidate in candidates:
        if candidate.is_dir():
            return candidate, year
    looked = ", ".join(repr(str(c)) for c in candidates)
    if not found:
        advice = (
            f"Pass torchvision's root (the folder holding VOCdevkit/VOC{year}) or the "
            f"VOC{year} folder itself."
        )
    elif len(found) == 1:
        other = found[0].name[3:]
        advice = (
            f"Found VOC{other} ({listed}): pass year={other!r} (--year {other} on the "
            "command line) or leave the year out."
        )
    else:
        names = ", ".join(path.name for path in found)
        advice = f"Found {names} ({listed}): pass year={years} (--year on the command line)."
    raise SourceNotFoundError(f"No Pascal VOC {year} folder found: looked for {looked}. {advice}")


def _check_year(year: object) -> None:
    """Refuse a ``year`` that is not 4 digits in a ``str``: torchvision's ``VOCDetection``
    refuses anything but a string too (``ValueError``, as ``SourceDataError`` is)."""
    if isinstance(year, str):
        if not _YEAR.fullmatch(year):
            raise SourceDataError(f"year must be 4 digits such as '2007', got {year!r}.")
        return
    if isinstance(year, bytes):
        text = year.decode("ascii", "replace")
    elif isinstance(year, float) and year.is_integer():
        text = str(int(year))
    else:
        text = str(year)
    hint = f": pass year={text!r}" if _YEAR.fullmatch(text) else ""
    raise SourceDataError(
        f"year must be a string such as '2007', as for torchvision's VOCDetection, got "
        f"{type(year).__name__} {year!r}{hint}."
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
    """The ``VOC<year>`` folders ``root`` holds, sorted: under ``VOCdevkit/`` and
    ``TrainVal/VOCdevkit/``, else directly in ``root`` if it is a ``VOCdevkit`` folder, else
    ``root`` itself if it is one."""
    found = sorted(
        {
            path
            for parent in (root / "VOCdevkit", root / "TrainVal" / "VOCdevkit")
            for path in _voc_folders(parent)
        }
    )
    if not found and root.name == "VOCdevkit":
        found = sorted(_voc_folders(root))
    if not found and _VOC_FOLDER.fullmatch(root.name) and root.is_dir():
        found = [root]
    return found


def _voc_folders(parent: Path) -> list[Path]:
    """The ``VOC<4 digits>`` directories directly inside ``parent`` (none if it is missing)."""
    if not parent.is_dir():
        return []
    return [p for p in parent.iterdir() if _VOC_FOLDER.fullmatch(p.name) and p.is_dir()]


def read_image_sets(
    voc_root: Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> dict[str, dict[str, list[str]]]:
    """Map task (``Main``, ``Segmentation``) -> list name -> ids, as torchvision reads them.

    Ids keep file order, duplicates and leading zeros. Besides the standard names, every other
    ``*.txt`` is a custom split, except per-class files such as ``aeroplane_train.txt``
    (every line ``id -1``, ``id 0`` or ``id 1``), which are skipped. Tasks without lists are
    left out.
    Only regular files of at most ``max_file_bytes`` are read (a FIFO named ``train.txt`` is
    refused, not waited on).
    """
    voc_root = Path(voc_root)
    image_sets = voc_root / "ImageSets"
    if not image_sets.is_dir():
        raise SourceNotFoundError(
            f"{str(image_sets)!r} does not exist. Create ImageSets/Main/train.txt (and val.txt, "
            "trainval.txt) with one image id per line, e.g. 000005 for JPEGImages/000005.jpg."
        )
    result: dict[str, dict[str, list[str]]] = {}
    for task in TASKS:
        folder = image_sets / task
        if not folder.is_dir():
            continue
        lists = _read_task(folder, max_file_bytes)
        if lists:
            result[task] = lists
    if not result:
        raise SourceNotFoundError(
            f"No list files in {str(image_sets)!r}: expected Main/train.txt, Main/val.txt, ... "
            "(or Segmentation/...). Create them with one image id per line."
        )
    return result


def _read_task(folder: Path, max_file_bytes: int) -> dict[str, list[str]]:
    """The id lists of one ImageSets sub-folder, standard names first, then custom ones sorted."""
    paths = {path.stem: path for path in folder.glob("*.txt") if not path.is_dir()}
    lists: dict[str, list[str]] = {}
    for name in (*STANDARD_IMAGE_SETS, *sorted(set(paths) - set(STANDARD_IMAGE_SETS))):
        path = paths.get(name)
        if path is None:
            continue
        lines = _read_lines(path, max_file_bytes)
        if name not in STANDARD_IMAGE_SETS and _per_class(lines):
            continue  # "000005 -1": which ids show a class, not a list of ids
        lists[name] = _ids(path, lines)
    return lists


def _per_class(lines: list[str]) -> bool:
    """Whether the lines are a VOC per-class file (``aeroplane_train.txt``): every line an id
    and ``-1``, ``0`` or ``1``. Any other file is a list of ids, read as torchvision reads
    one (an id may hold spaces: ``my img 1``), so a custom split is never dropped unseen.
    Blank lines are let by (a per-class file is never read as ids)."""
    rows = [line.split() for line in lines if line]
    return bool(rows) and all(len(row) == 2 and row[1] in ("-1", "0", "1") for row in rows)


def _read_lines(path: Path, max_file_bytes: int) -> list[str]:
    """torchvision's ``[x.strip() for x in open(path).readlines()]`` (universal newlines)."""
    try:
        text = read_list_file(path, max_file_bytes).decode("utf-8")
        return [line.strip() for line in io.StringIO(text, newline=None).readlines()]
    except UnicodeDecodeError as exc:
        raise SourceDataError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
            "save the list as plain UTF-8 (ASCII) with one image id per line."
        ) from None


def _ids(path: Path, lines: list[str]) -> list[str]:
    """Check a list's stripped lines and return them as ids."""
    if lines and lines[0].startswith("\ufeff"):
        raise SourceDataError(
            f"{path}, line 1: starts with a byte order mark, which torchvision would keep in the "
            "first id; save the file as UTF-8 without BOM."
        )
    if "" not in lines and "." not in lines and ".." not in lines:
        joined = "".join(lines)
        if "/" not in joined and "\\" not in joined and "\0" not in joined:
            return lines  # the common case, checked without a loop over the lines
    for number, line in enumerate(lines, start=1):
        if not line:
            raise SourceDataError(
                f"{path}, line {number}: blank line; torchvision would read it as an empty id and "
                "look for JPEGImages/.jpg. Delete blank lines (including trailing ones)."
            )
        if "/" in line or "\\" in line or "\0" in line or line in (".", ".."):
            raise SourceDataError(
                f"{path}, line {number}: id {line!r} is a path, not a file name; it would read "
                "(and export would write) outside the VOC folder. Use plain ids (2008_000123)."
            )
    return lines


def image_set_files(
    voc_root: Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> Iterator[tuple[str, bytes]]:
    """Every list file under ImageSets, as ``(devkit-relative path, raw bytes)``, sorted, so
    ``export`` can restore them byte for byte."""
    base = voc_root / "ImageSets"
    for path in sorted(base.rglob("*.txt")):
        if not path.is_dir():
            yield path.relative_to(voc_root).as_posix(), read_list_file(path, max_file_bytes)


def read_list_file(path: Path, max_file_bytes: int) -> bytes:
    """The bytes of an ImageSets list file: a regular file of at most ``max_file_bytes``."""
    try:
        return read_regular_file(path, max_file_bytes, "the list file")
    except (FileKindError, FileSizeError) as exc:
        raise SourceDataError(f"{exc}; replace it with a plain text file of ids") from None
    except OSError as exc:
        raise SourceDataError(f"{path}: cannot read the list file: {exc.strerror or exc}") from None


#: Other spellings of an extension that exports use (cameras, Roboflow) and torchvision does
#: not read: looked for only when the expected file is missing, to name the one that is there.
_NEAR_MISSES: Final[Mapping[str, tuple[str, ...]]] = {
    ".jpg": (".JPG", ".jpeg", ".JPEG", ".Jpg", ".png", ".PNG"),
    ".xml": (".XML",),
    ".png": (".PNG",),
}


def near_miss(path: str) -> str | None:
    """A file beside the missing ``path`` with the same stem and another spelling of its
    extension (``000002.JPG`` for ``000002.jpg``), if there is one: a few ``stat`` calls,
    no folder listing, so a folder of thousands of such files stays cheap to report."""
    stem, ext = os.path.splitext(path)
    for other in _NEAR_MISSES.get(ext, ()):
        if os.path.isfile(stem + other):
            return stem + other
    return None
