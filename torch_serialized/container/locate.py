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
    if path.name == fmt.MANIFEST_NAME:
        path = path.parent
    moved = _moved_aside(path)
    if moved is None:  # swapped at every look: re-packed again and again
        raise FileChangedError(
            f"{path} is being replaced by new packs faster than it can be opened; open it again"
        )
    aside, pid = moved
    real = aside.parent / Path(os.path.realpath(path)).name  # a link's target was swapped
    if not fileio.pid_alive(pid):  # killed between its two renames, or the new pack deleted since
        missing = f"{path} links to {real}, which" if os.path.islink(path) else f"{path}"
        raise FileNotFoundError(
            f"{missing} does not exist, and {aside} holds the pack that a re-pack (process "
            f"{pid}, not running on this machine) moved aside to replace it and never "
            f"replaced: rename it to {real} to read that pack (the next pack of {real} does "
            f"so before it writes), or delete it if {real.name} was removed on purpose. If a "
            "pack on another machine is writing it, open it again"
        )
    raise FileChangedError(
        f"{path} is being replaced: a re-pack (process {pid}) moved the previous pack aside "
        f"to {aside} and has not renamed the new one into place yet; open it again. If no pack "
        f"of it is running (process {pid} is another program now), rename {aside.name} back "
        f"to {real.name} (the next pack of {real} does)"
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
        voc = _voc_marks(path)
        if voc is not None:
            raise FormatError(
                f"{path} is a VOC root ({voc}), not a pack: pack it first with `torch-serialized "
                "pack` (torch_serialized.pack_voc), then pass the .tser file or shard folder"
            ) from None
        return path, None, None
    except OSError as exc:
        if fileio.out_of_files(exc):
            raise fileio.too_many_files(manifest_path, exc) from None
        raise
    return path, manifest_path, data


def _voc_marks(path: Path) -> str | None:
    """What makes ``path`` a VOC source (e.g. ``"VOCdevkit/"``), or None; only names looked at."""
    for name in ("VOCdevkit", "TrainVal/VOCdevkit"):
        if (path / name).is_dir():
            return f"{name}/"
    for folder in (path, *sorted(path.glob("VOC[0-9][0-9][0-9][0-9]"))):
        found = [name for name in ("Annotations", "JPEGImages") if (folder / name).is_dir()]
        if found:
            return f"{'' if folder == path else folder.name + '/'}{', '.join(found)}"
    return None


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
