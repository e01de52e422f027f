"""Finding a pack on disk while a re-pack may be swapping it, and checking a downloaded file.

A re-pack of a shard folder moves the old folder aside and renames the new one into place
(``fileio.AtomicOutput``): for a moment the path is missing. ``find`` looks again rather than
calling the path empty, and says what happened when the swap never completes (a writer killed
between its two renames). ``intact`` is the check a download must pass before it enters the
cache. This module never imports torch.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptFileError, FileChangedError, FormatError
from . import spec as fmt
from .fileio import (
    FileKindError,
    FileSizeError,
    out_of_files,
    pid_alive,
    read_regular_file,
    temporaries,
    too_many_files,
)
from .manifest import Expected
from .reader import ContainerReader

if TYPE_CHECKING:
    from ..remote.packs import RemotePack

__all__ = ["find", "intact"]


def find(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> tuple[Path, Path | None, bytes | None, RemotePack | None]:
    """Where the pack at ``location`` lives: its local path, for a shard folder its manifest's
    path and bytes (read as a regular file of bounded size), and for a URL the ``RemotePack``
    that fetches its files into the cache (the local path is then the cache's copy)."""
    from ..remote.store import is_url

    remote = None
    if is_url(location):
        from ..remote.packs import resolve

        url = str(location)
        if url.rstrip("/").endswith("/" + fmt.MANIFEST_NAME):
            url = url.rstrip("/")[: -len(fmt.MANIFEST_NAME) - 1]
        remote = resolve(
            url,
            storage_options,
            cache_dir,
            cache_limit_bytes,
            verify_file=intact(),
        )
        path = remote.path
    else:
        path = Path(location)
    for pause in (*_SWAP_PAUSES, None):
        found = _look(path)
        if found is not None:
            return (*found, remote)
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
    real = aside.parent / Path(os.path.realpath(path)).name  # a link's target is what was swapped
    if not pid_alive(pid):  # killed between its two renames, or the new pack deleted since
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


#: The pauses (seconds) between looks at a shard folder that a re-pack is swapping: about
#: 31 ms in all. ``fileio.AtomicOutput.commit`` moves the old folder aside and renames the new
#: one into place right after (two renames, nothing between), so the folder is missing for
#: microseconds, unless the writer is descheduled between them; an open that sees the swap
#: looks again rather than calling the path empty or no pack. Only taken when a swap is seen.
_SWAP_PAUSES = (0.001, 0.002, 0.004, 0.008, 0.016)


def _pause(seconds: float) -> None:
    """Wait between two looks at a folder being swapped (a seam for the tests)."""
    time.sleep(seconds)


def _look(path: Path) -> tuple[Path, Path | None, bytes | None] | None:
    """One look at the local pack at ``path``: ``(path, manifest path, manifest bytes)`` for
    a shard folder, ``(path, None, None)`` for anything else (a file, a folder without a
    manifest: ``ContainerReader`` says what it is). ``None`` when a re-pack is swapping the
    folder right now: it is missing and moved aside, or it was swapped while its manifest
    was read. ``path`` may also be a shard folder's ``manifest.json``."""
    if path.name == fmt.MANIFEST_NAME and not path.is_dir() and os.path.lexists(path):
        path = path.parent
    try:
        before = os.stat(path)
    except (FileNotFoundError, NotADirectoryError) as exc:  # others (EACCES) say themselves
        folder = path.parent if path.name == fmt.MANIFEST_NAME else path
        if isinstance(exc, FileNotFoundError) and _moved_aside(folder) is not None:
            return None  # a swap under way (its writer may run on another machine): look again
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
    except (FileKindError, FileSizeError) as exc:
        raise CorruptFileError(f"{exc}; {fmt.DAMAGED}") from None
    except FileNotFoundError:
        if not _same_file(path, before):
            return None  # the folder was swapped while it was read: look again
        if os.path.lexists(manifest_path):  # a dangling link named manifest.json
            raise
        return path, None, None
    except OSError as exc:
        if out_of_files(exc):
            raise too_many_files(manifest_path, exc) from None
        raise
    return path, manifest_path, data


def _same_file(path: Path, before: os.stat_result) -> bool:
    """Whether ``path`` is still the file or folder ``before`` describes."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (before.st_dev, before.st_ino)


def _moved_aside(path: Path) -> tuple[Path, int] | None:
    """The folder (or file) a writer moved aside to replace ``path`` (a link: its target)
    with a new pack, and the writer's pid, if there is one: ``.{name}.old-{pid}-{hex}``
    beside it (``fileio.temp_sibling``); one whose writer runs first."""
    found = [
        (entry, pid)
        for kind, pid, entry in temporaries(Path(os.path.realpath(path)))
        if kind == "old"
    ]
    return max(found, key=lambda moved: pid_alive(moved[1]), default=None)


def intact(expect: Expected | None = None) -> Callable[[Path], bool]:
    """A download check: the file at a path is a whole container (of ``expect``, a manifest
    entry, when given) whose arrays and records all match their CRC32s."""

    def check(path: Path) -> bool:
        try:
            container = ContainerReader(path, expect=expect)
        except FormatError:
            return False
        try:
            return not container.verify()
        finally:
            container.close()

    return check
