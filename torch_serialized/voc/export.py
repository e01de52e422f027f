"""Unpack a VOC pack back into a VOCdevkit folder, byte for byte.

``export_voc`` is the inverse of ``pack_voc`` for packs that keep the original files
(``image_storage="original"``, no ``max_size``): it writes ``JPEGImages``, ``Annotations``,
``SegmentationClass``, ``SegmentationObject`` and every stored ``ImageSets`` list file under
``out_root/<base_dir>`` (``VOCdevkit/VOC2012``, say), so torchvision's ``root=out_root`` reads
the result. Files the source had but no list named are not in a pack and are not restored.

A pack is untrusted input: every id and stored path is checked before anything is written, and
one that would land outside ``out_root`` is refused. Folders below ``out_root`` are opened one
component at a time with ``O_NOFOLLOW`` and files written through those descriptors, so a
symbolic link anywhere below ``out_root`` (``VOCdevkit/VOC2007/JPEGImages`` pointing elsewhere,
say) is refused, never followed. Records are read with their checksums verified.

An export is all or nothing: every file is first written into a hidden temporary sibling
(``fileio.AtomicOutput``) of the shallowest missing folder of ``out_root/<base_dir>``, which is
renamed into place at the end. When that folder exists already (export into an existing
devkit, with ``overwrite`` or beside files of the user) the staged files are renamed into it
one by one, each replaced file moved aside first, and all of it is undone if one rename
fails. On any failure (a damaged record, a full disk, Ctrl-C) the temporaries are removed and
``out_root`` holds what it held before.
"""

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
from . import schema
from .packed import VOCPackReader

__all__ = ["export_voc"]

#: (field, flag that says the record has it, folder, extension) of each file of an id
_OUTPUTS = tuple(
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
    """Rebuild ``out_root/<base_dir>/`` from the pack at ``path`` (local, or a URL read
    through the cache as ``VOCSerializedDataset`` reads it); return that folder.

    Raises ``ValueError`` for packs that do not hold the original files, ``FormatError`` for
    ids or stored paths that are unsafe (``..``, absolute, separators, NUL), ``ChecksumError``
    for a damaged record, and ``WriteError`` (``EEXIST``) when a file to write already exists
    and ``overwrite`` is false; that check happens before anything is written. On any error
    or interruption nothing of the export is left: ``out_root`` holds what it held before.
    """
    pack = VOCPackReader(
        path,
        checked=True,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit_bytes=cache_limit_bytes,
    )
    if pack.image_storage != "original" or pack.meta.get("max_size") is not None:
        raise ValueError(
            f"{pack.name} was packed with image_storage={pack.image_storage!r} and "
            f"max_size={pack.meta.get('max_size')!r}: its images are not the original files, "
            "so it cannot be exported byte for byte; export a pack made with the defaults"
        )
    out_root = Path(out_root)
    base = _safe_parts(pack.base_dir, f"{pack.name}: base_dir")
    final = out_root.joinpath(*base)
    plan = list(_plan(pack, pack.files()))
    with _Tree(out_root, out_root) as existing:
        depth = existing.existing_depth(base)  # refuses a link below out_root
    if depth < len(base):
        # Part of out_root/<base_dir> is missing: build it aside, then one rename.
        top = out_root.joinpath(*base[: depth + 1])
        _stage_and_rename(pack, plan, top, base[depth + 1 :], final, progress)
    else:
        _stage_and_merge(pack, plan, final, overwrite, progress)
    return final


_Folder = tuple[str, ...]
#: One planned file: (folder relative to out_root/<base_dir>, name, record, field, list bytes).
_Plan = list[tuple[_Folder, str, int, int, bytes | None]]


def _stage(pack: VOCPackReader, plan: _Plan, tree: _Tree, progress: bool) -> None:
    """Write every planned file into ``tree``."""
    for folder, name, record, field, stored in tqdm(
        plan, desc="exporting", unit="file", disable=not progress
    ):
        try:
            data = pack.field(record, field) if stored is None else stored
        except ChecksumError as exc:  # name the sample, not only the file's record
            raise pack.named(exc) from None
        tree.write(folder, name, data)


def _stage_and_rename(
    pack: VOCPackReader, plan: _Plan, top: Path, below: _Folder, final: Path, progress: bool
) -> None:
    """``top`` does not exist: write it complete under a temporary name, then rename it."""
    if not top.parent.exists():  # out_root's parents: created as before, never removed
        top.parent.mkdir(parents=True, exist_ok=True)
    output = AtomicOutput(top, folder=True)
    try:
        with _Tree(output.path.joinpath(*below), final) as tree:
            _stage(pack, plan, tree, progress)
        output.commit()
    except BaseException:
        output.abort()
        raise


def _stage_and_merge(
    pack: VOCPackReader, plan: _Plan, final: Path, overwrite: bool, progress: bool
) -> None:
    """``final`` exists: stage every file beside it, then rename each into it, undoing all of
    it if one rename fails, so ``final`` ends with every file or as it was."""
    with _Tree(final, final) as target:
        for folder in sorted({folder for folder, *_ in plan}):
            target.lookup(folder, create=False)  # a link at any planned folder: refused now
        if not overwrite:
            for folder, name, *_ in plan:
                if target.exists(folder, name):
                    raise WriteError(
                        errno.EEXIST,
                        f"{final.joinpath(*folder, name)} already exists; export into an "
                        "empty folder or pass overwrite=True (--overwrite) to replace the files",
                    )
        output = AtomicOutput(final, folder=True)
        try:
            with _Tree(output.path, final) as staged, _Tree(output.scratch(), final) as aside:
                _stage(pack, plan, staged, progress)
                _merge(plan, staged, target, aside, overwrite)
        finally:
            output.abort()  # the staging folder is empty now, or the export failed


def _merge(plan: _Plan, staged: _Tree, target: _Tree, aside: _Tree, overwrite: bool) -> None:
    """Rename each staged file into ``target``, a file it replaces moved into ``aside`` first;
    on any failure put everything back as it was and raise."""
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
    """The folders below ``root``, each opened from its parent's descriptor with
    ``O_NOFOLLOW`` (created first when writing), so nothing below ``root`` is reached through
    a symbolic link. ``root`` itself is the caller's choice and may be one. Messages name
    ``shown`` (the final folder) in place of ``root`` (perhaps a temporary)."""

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
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
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
                fd = os.open(folder[-1], flags | getattr(os, "O_NOFOLLOW", 0), dir_fd=parent)
        except FileNotFoundError:
            if create:
                raise
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise WriteError(
                    exc.errno,
                    f"{path} is a symbolic link or not a folder; export writes only into real "
                    "folders below the output folder, never through a link: remove it or "
                    "export elsewhere",
                ) from None
            raise WriteError(
                exc.errno or errno.EIO, f"cannot create {path}: {exc.strerror or exc}"
            ) from exc
        self._fds[folder] = fd
        return fd

    def open(self, folder: _Folder) -> int:
        """The descriptor of ``root/folder``, created if missing."""
        fd = self.lookup(folder, create=True)
        assert fd is not None
        return fd

    def existing_depth(self, folder: _Folder) -> int:
        """How many leading components of ``folder`` exist below ``root`` (-1: not even
        ``root``), refusing a link or a file on the way."""
        for depth in range(len(folder), -1, -1):
            if self.lookup(folder[:depth], create=False) is not None:
                return depth
        return -1

    def remove_created(self) -> None:
        """Remove the folders this tree created (empty again after a rollback), deepest first."""
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
        """Write one file atomically (``fileio.replace_file_at``), failing with a
        ``WriteError``."""
        try:
            replace_file_at(self.open(folder), name, data)
        except OSError as exc:
            if isinstance(exc, WriteError):
                raise
            target = self.shown.joinpath(*folder, name)
            raise WriteError(
                exc.errno or errno.EIO,
                f"writing {target} failed: {exc.strerror or exc}; the export was undone "
                "(nothing of it is left), free space or fix the cause and run it again",
            ) from exc


def _plan(
    pack: VOCPackReader, files: dict[str, bytes]
) -> Iterator[tuple[_Folder, str, int, int, bytes | None]]:
    """``(folder, name, record, field, None)`` per record file, ``(folder, name, -1, -1,
    bytes)`` per list file, folders relative to ``out_root/<base_dir>``. Raises on an unsafe id or
    path; the caller lists the whole plan first."""
    flags = pack.columns["flags"]
    seen: set[str] = set()
    for record in pack.live.tolist():  # a record an append retired is not in the devkit
        image_id = pack.id(record)
        where = f"{pack.name}: record {record} id {image_id!r}"
        _check_id(image_id, where)
        if image_id in seen:
            raise FormatError(f"{where}: the id is stored twice; the pack is damaged, re-pack it")
        seen.add(image_id)
        for field, flag, folder, ext in _OUTPUTS:
            if flag == 0 or int(flags[record]) & flag:
                yield (folder,), f"{image_id}{ext}", record, field, None
    for name in sorted(files):
        parts = _safe_parts(name, f"{pack.name}: stored list file {name!r}")
        if parts[0] != "ImageSets" or len(parts) < 2:
            raise FormatError(
                f"{pack.name}: stored list file {name!r} is not under ImageSets/; refusing to "
                "write it (the pack was not made by pack_voc, or is damaged)"
            )
        yield parts[:-1], parts[-1], -1, -1, files[name]


def _check_id(image_id: str, where: str) -> None:
    """Refuse ids that are not a plain file-name stem (they could escape ``out_root``)."""
    bad = (
        image_id in ("", ".", "..")
        or "/" in image_id
        or "\\" in image_id
        or "\x00" in image_id
        or (os.altsep is not None and os.altsep in image_id)
    )
    if bad:
        raise FormatError(
            f"{where}: refusing to export an id that is empty, '.', '..' or holds a path "
            "separator or NUL (it would write outside the output folder); the pack is unsafe"
        )


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
        raise FormatError(
            f"{where}: refusing unsafe path {relative!r} (absolute, '..', NUL or empty "
            "parts would write outside the output folder); the pack is unsafe"
        )
    return parts
