"""Finding a pack while a re-pack may be swapping it (``fileio.AtomicOutput`` moves the old folder
aside, renames the new one in): ``find`` looks again rather than call it missing, and says what
happened if the swap never completes. ``intact``: the check a download passes to enter the cache."""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptFileError, FileChangedError, FormatError
from . import fileio
from . import spec as fmt
from .fileio import read_regular_file  # a seam for the tests
from .manifest import Expected
from .reader import ContainerReader

if TYPE_CHECKING:
    from ..remote.packs import RemotePack

__all__ = ["find", "intact"]

#: Pauses (seconds, ~31 ms in all) between looks at a folder a re-pack is swapping: the two
#: renames follow each other at once, unless the writer is descheduled between them.
_SWAP_PAUSES = (0.001, 0.002, 0.004, 0.008, 0.016)


def find(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> tuple[Path, Path | None, bytes | None, RemotePack | None]:
    """Where the pack at ``location`` lives: its local path (for a URL, the cache's copy), a
    shard folder's manifest path and bytes, and for a URL the ``RemotePack`` filling the cache."""
    from ..remote.store import is_url

    if is_url(location):  # the cache's copy: never swapped
        from ..remote.packs import resolve

        url = str(location).rstrip("/").removesuffix("/" + fmt.MANIFEST_NAME)
        remote = resolve(url, storage_options, cache_dir, cache_limit_bytes, verify_file=intact())
        return remote.path, remote.manifest_path, remote.manifest, remote
    path = Path(location)
    for pause in (*_SWAP_PAUSES, None):
        found = _look(path)
        if found is not None:
            return (*found, None)
        if pause is not None:
            _pause(pause)
    folder = path.parent if path.name == fmt.MANIFEST_NAME else path
    aside, pid = _moved_aside(folder) or (None, 0)
    if aside is None:  # swapped at every look: re-packed again and again
        raise FileChangedError(f"{folder} is being re-packed again and again; open it again")
    real = aside.parent / Path(os.path.realpath(folder)).name  # a link's target was swapped
    if fileio.pid_alive(pid):
        raise FileChangedError(
            f"{folder} is being replaced by a re-pack (process {pid}); open it again. If none "
            f"runs, rename {aside} back to {real} (the next pack of it does)"
        )
    raise FileNotFoundError(
        f"{folder} does not exist; {aside} holds the pack a killed re-pack (process {pid}) moved "
        f"aside: rename it to {real} to read it (the next pack of it does), or delete it"
    )


def _pause(seconds: float) -> None:
    """Wait between two looks at a folder being swapped (a seam for the tests)."""
    time.sleep(seconds)


def _look(path: Path) -> tuple[Path, Path | None, bytes | None] | None:
    """One look at ``path`` (or its ``manifest.json``): a shard folder's ``(path, manifest path,
    bytes)``, ``(path, None, None)`` for anything else, ``None`` while a re-pack swaps it."""
    if path.name == fmt.MANIFEST_NAME and not path.is_dir() and os.path.lexists(path):
        path = path.parent
    try:
        before = os.stat(path)
    except (FileNotFoundError, NotADirectoryError) as exc:  # others (EACCES) say themselves
        folder = path.parent if path.name == fmt.MANIFEST_NAME else path
        if isinstance(exc, FileNotFoundError) and _moved_aside(folder) is not None:
            return None  # a swap under way (its writer may run on another machine)
        if os.path.lexists(path):  # a dangling link, say: opening it names what is wrong
            return path, None, None
        raise FileNotFoundError(
            f"{path} does not exist; pack a VOC dataset first with torch_serialized.pack_voc "
            "or `torch-serialized pack`"
        ) from None
    if not stat.S_ISDIR(before.st_mode):
        return path, None, None
    manifest_path = path / fmt.MANIFEST_NAME
    try:
        data = read_regular_file(manifest_path, fmt.MAX_MANIFEST_BYTES, "the manifest")
    except (fileio.FileKindError, fileio.FileSizeError) as exc:
        raise CorruptFileError(f"{exc}; {fmt.DAMAGED}") from None
    except FileNotFoundError:
        try:
            now = os.stat(path)
        except OSError:
            return None  # the folder was swapped while it was read: look again
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            return None
        if os.path.lexists(manifest_path):  # a dangling link named manifest.json
            raise
        if _is_voc_root(path):
            raise FormatError(
                f"{path} is a VOC root (VOCdevkit or VOC20xx folders), not a pack: pack it first "
                "with `torch-serialized pack` (torch_serialized.pack_voc)"
            ) from None
        return path, None, None
    return path, manifest_path, data


def _is_voc_root(path: Path) -> bool:
    """Whether ``path`` is or holds a VOC source folder (only names looked at)."""
    marks = ("VOCdevkit", "TrainVal/VOCdevkit", "Annotations", "JPEGImages")
    folders = [*(path / mark for mark in marks), *path.glob("VOC[0-9][0-9][0-9][0-9]")]
    return any(folder.is_dir() for folder in folders)


def _moved_aside(path: Path) -> tuple[Path, int] | None:
    """``(aside, pid)``: what a writer moved aside for ``path`` (``.{name}.old-{pid}-{hex}``)."""
    real = Path(os.path.realpath(path))
    found = [(entry, pid) for kind, pid, entry in fileio.temporaries(real) if kind == "old"]
    return max(found, key=lambda moved: fileio.pid_alive(moved[1]), default=None)


def intact(expect: Expected | None = None) -> Callable[[Path], bool]:
    """A download check: a whole container (of manifest entry ``expect``), all CRC32s matching."""

    def check(path: Path) -> bool:
        try:
            container = ContainerReader(path, expect=expect)
        except FormatError:
            return False
        with contextlib.closing(container):
            return not container.verify()

    return check
