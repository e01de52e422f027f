"""``export_voc``: a VOC pack back into a VOCdevkit folder, byte for byte. A pack is untrusted: ids
and paths are checked first, folders opened with ``O_NOFOLLOW`` (links refused). All or nothing:
staged in a hidden folder, then renamed in as one folder or file by file, undone on failure."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from tqdm.auto import tqdm

from ..container.fileio import AtomicOutput, replace_file_at
from ..errors import ChecksumError, FormatError, WriteError
from ..remote.store import is_url
from . import schema
from .packed import VOCPackReader

__all__ = ["export_voc"]

_OUTPUTS = tuple(  #: (field, flag, folder, extension) per file of an id
    zip(range(4), schema.SOURCE_FLAGS, schema.SOURCE_FOLDERS, schema.SOURCE_EXTENSIONS)
)


def export_voc(
    path: str | os.PathLike[str],
    out_root: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit_bytes: int | None = None,
) -> Path:
    """Rebuild ``out_root/<base_dir>/`` (what torchvision's ``root=out_root`` reads) from the
    pack at ``path``, local or a URL; return that folder.

    Raises ``ValueError`` for a pack without the original files, ``FormatError`` for an unsafe id or
    path, ``ChecksumError`` for a damaged record, and ``WriteError`` (``EEXIST``, before writing)
    for an existing file without ``overwrite``. On any error ``out_root`` is left as it was."""
    if is_url(out_root):  # a Path would write a local folder named "https:"
        raise ValueError(f"{out_root} is a URL: export writes a local folder; upload it after")
    pack = VOCPackReader(
        path,
        checked=True,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit_bytes=cache_limit_bytes,
    )
    if pack.image_storage != "original" or pack.meta.get("max_size") is not None:
        raise ValueError(
            f"{pack.name} was packed with image_storage={pack.image_storage!r} and max_size="
            f"{pack.meta.get('max_size')!r}: it cannot be exported byte for byte; re-pack it "
            "with the defaults"
        )
    out_root = Path(out_root)
    base = _safe_parts(pack.base_dir, f"{pack.name}: base_dir")
    final = out_root.joinpath(*base)
    plan = list(_plan(pack, pack.files()))
    with _Tree(out_root, out_root) as existing:
        depth = len(base)  # how many folders of base exist (-1: not even out_root)
        while depth >= 0 and existing.lookup(base[:depth], create=False) is None:
            depth -= 1  # a link below out_root is refused here
        for folder, name, *_ in plan if depth == len(base) else []:
            if existing.exists((*base, *folder), name) and not overwrite:  # refuses links too
                raise WriteError(
                    errno.EEXIST,
                    f"{final.joinpath(*folder, name)} already exists; export into an empty "
                    "folder or pass overwrite=True (--overwrite) to replace the files",
                )
    # staged beside the first missing folder (renamed in whole) or beside an existing ``final``
    top = out_root.joinpath(*base[: depth + 1])
    top.parent.mkdir(parents=True, exist_ok=True)  # out_root's parents: never removed
    output = AtomicOutput(top, folder=True)
    try:
        with _Tree(output.path.joinpath(*base[depth + 1 :]), final) as staged:
            for folder, name, record, field, stored in tqdm(
                plan, desc="exporting", unit="file", disable=not progress
            ):
                try:
                    data = pack.field(record, field) if stored is None else stored
                except ChecksumError as exc:  # name the sample, not only the file's record
                    raise pack.named(exc) from None
                staged.write(folder, name, data)
            if depth < len(base):
                output.commit()
            else:
                with _Tree(final, final) as target, _Tree(output.scratch(), final) as aside:
                    _merge(plan, staged, target, aside, overwrite)
    finally:
        output.abort()  # after a commit or merge: nothing left to remove
    return final


_Folder = tuple[str, ...]
#: One planned file: (folder relative to out_root/<base_dir>, name, record, field, list bytes).
_File = tuple[_Folder, str, int, int, bytes | None]


def _merge(plan: list[_File], staged: _Tree, target: _Tree, aside: _Tree, overwrite: bool) -> None:
    """Rename staged files into ``target`` (replaced ones to ``aside``), all undone on failure."""
    done: list[tuple[_Folder, str, bool]] = []
    try:
        for folder, name, *_ in plan:
            into = target.open(folder)
            replaced = target.exists(folder, name)
            if replaced and not overwrite:  # it appeared since the check
                raise WriteError(
                    errno.EEXIST,
                    f"{target.shown.joinpath(*folder, name)} appeared during the export; "
                    "nothing was changed, export again (with --overwrite to replace it)",
                )
            if replaced:
                os.replace(name, name, src_dir_fd=into, dst_dir_fd=aside.open(folder))
            done.append((folder, name, replaced))
            os.replace(name, name, src_dir_fd=staged.open(folder), dst_dir_fd=into)
    except BaseException as exc:
        for folder, name, replaced in reversed(done):
            with contextlib.suppress(OSError):
                if replaced:
                    os.replace(
                        name, name, src_dir_fd=aside.open(folder), dst_dir_fd=target.open(folder)
                    )
                else:
                    os.unlink(name, dir_fd=target.open(folder))
        target.remove_created()
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise WriteError(
                exc.errno or errno.EIO,
                f"moving the exported files into {target.shown} failed: "
                f"{exc.strerror or exc}; nothing was changed there",
            ) from exc
        raise


class _Tree:
    """The folders below ``root`` (maybe a link), each opened from its parent with
    ``O_NOFOLLOW``; messages name ``shown``."""

    def __init__(self, root: Path, shown: Path) -> None:
        self.root = root
        self.shown = shown
        self._fds: dict[_Folder, int] = {}
        self._created: list[_Folder] = []

    def __enter__(self) -> _Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def lookup(self, folder: _Folder, create: bool) -> int | None:
        """The descriptor of ``root/folder``; ``None`` if it does not exist and not ``create``."""
        if folder in self._fds:
            return self._fds[folder]
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        path = self.shown.joinpath(*folder)
        try:
            if not folder:
                if create:
                    self.root.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.root, flags)
            else:
                parent = self.lookup(folder[:-1], create)
                if parent is None:
                    return None
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(folder[-1], dir_fd=parent)
                        self._created.append(folder)
                fd = os.open(folder[-1], flags | os.O_NOFOLLOW, dir_fd=parent)
        except FileNotFoundError:
            if create:
                raise
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise WriteError(
                    exc.errno,
                    f"{path} is a symbolic link or not a folder; export never writes through a "
                    "link: remove it or export elsewhere",
                ) from None
            raise WriteError(
                exc.errno or errno.EIO, f"cannot create {path}: {exc.strerror or exc}"
            ) from exc
        self._fds[folder] = fd
        return fd

    def open(self, folder: _Folder) -> int:
        fd = self.lookup(folder, create=True)
        assert fd is not None
        return fd

    def remove_created(self) -> None:
        """Remove the folders this tree created (empty after a rollback), deepest first."""
        for folder in reversed(self._created):
            with contextlib.suppress(OSError):
                os.rmdir(folder[-1], dir_fd=self._fds[folder[:-1]])
        self._created.clear()

    def exists(self, folder: _Folder, name: str) -> bool:
        fd = self.lookup(folder, create=False)
        if fd is None:
            return False
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def write(self, folder: _Folder, name: str, data: bytes | memoryview) -> None:
        """Write one file atomically (``WriteError`` on failure)."""
        fd = self.open(folder)
        try:
            replace_file_at(fd, name, data)
        except OSError as exc:
            target = self.shown.joinpath(*folder, name)
            raise WriteError(
                exc.errno or errno.EIO,
                f"writing {target} failed: {exc.strerror or exc}; the export was undone "
                "(nothing of it is left), free space or fix the cause and run it again",
            ) from exc


def _plan(pack: VOCPackReader, files: dict[str, bytes]) -> Iterator[_File]:
    """``(folder, name, record, field, None)`` per record file and ``(folder, name, -1, -1,
    bytes)`` per list file (folders below ``out_root/<base_dir>``); raises on unsafe ids, paths."""
    flags = pack.columns["flags"]
    seen: set[str] = set()
    for record in pack.live.tolist():  # a record an append retired is not in the devkit
        image_id = pack.id(record)
        where = f"{pack.name}: record {record} id {image_id!r}"
        if image_id in ("", ".", "..") or any(c in image_id for c in "/\\\x00"):
            raise FormatError(
                f"{where}: refusing an id that is not a file name; the pack is unsafe"
            )
        if image_id in seen:
            raise FormatError(f"{where}: the id is stored twice; the pack is damaged, re-pack it")
        seen.add(image_id)
        for field, flag, folder, ext in _OUTPUTS:
            if flag == 0 or int(flags[record]) & flag:
                yield (folder,), f"{image_id}{ext}", record, field, None
    for name in sorted(files):
        parts = _safe_parts(name, f"{pack.name}: stored list file {name!r}")
        if parts[0] != "ImageSets" or len(parts) < 2:
            raise FormatError(f"{pack.name}: stored list file {name!r} is not under ImageSets/")
        yield parts[:-1], parts[-1], -1, -1, files[name]


def _safe_parts(relative: str, where: str) -> tuple[str, ...]:
    """The components of a stored relative path, refusing anything that could escape."""
    parts = PurePosixPath(relative.replace("\\", "/")).parts
    if (
        not parts
        or relative.startswith(("/", "\\"))
        or "\x00" in relative
        or ":" in parts[0]  # a Windows drive: C:foo
        or any(part in ("", ".", "..") for part in parts)
        or (relative != "/".join(parts) and relative != "\\".join(parts))
    ):
        raise FormatError(f"{where}: refusing unsafe path {relative!r}; the pack is unsafe")
    return parts
