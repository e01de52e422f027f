"""Packs written to a URL: written locally, then uploaded, the manifest last. Files get a fresh
token (docs/FORMAT.md, "Shard folders"), so a re-pack never overwrites what readers of the last
manifest read; ``prune_remote`` removes those files once nobody reads them."""

from __future__ import annotations

import functools
import os
import re
import tempfile
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ..container import spec as fmt
from ..container.manifest import parse_manifest
from ..errors import RemoteAccessError, RemoteError, RemoteNotFoundError
from .store import (
    HTTP_PROTOCOLS,
    LOCAL_PROTOCOLS,
    RemoteStore,
    is_url,
    protocol_of,
    redact_url,
)

__all__ = ["check_writable", "prune_remote", "upload_file", "upload_folder", "write_then_upload"]

#: The only names ``prune_remote`` ever deletes: a pack's shards and catalogs.
_PACK_FILE = re.compile(r"^(shard-\d+|catalog)(-[0-9a-f]+)?\.tser$")
REPORT_SUFFIX = ".skipped.json"  # the skipped-samples report (``voc.records.REPORT_SUFFIX``)

R = TypeVar("R")


def check_writable(url: str, verb: str) -> None:
    """Refuse to ``verb`` ("pack", "append") at a read-only (HTTP) URL before any work is done."""
    protocol = protocol_of(url)
    if protocol in HTTP_PROTOCOLS:
        raise ValueError(
            f"{redact_url(url)}: packs at {protocol}:// URLs are read-only here (HTTP has no "
            f"uploads); {verb} to a writable URL (s3://, gs://, file://...) or to a local "
            "path, and serve that"
        )


def write_then_upload(
    url: str,
    storage_options: Mapping[str, Any] | None,
    write: Callable[[Path], R],
    *,
    written: Callable[[R], Path],
    report: Callable[[R], Path | None] = lambda _result: None,
) -> R:
    """Run ``write(local_path)`` in a temporary folder, then upload ``written(result)`` (manifest
    last) to ``url`` and ``report(result)``, if any, as ``url + ".skipped.json"``."""
    store = RemoteStore(url, storage_options)
    with tempfile.TemporaryDirectory(prefix="torch_serialized-upload-") as tmp:
        result = write(Path(tmp) / (store.url.rsplit("/", 1)[-1] or "pack"))
        local = written(result)
        if local.is_dir():
            upload_folder(store, local)
        else:
            upload_file(store, local)
        skipped = report(result)
        if skipped is not None:
            upload_file(RemoteStore(store.url + REPORT_SUFFIX, storage_options), skipped)
    return result


def upload_file(store: RemoteStore, local: str | os.PathLike[str], key: str = "") -> None:
    """Upload ``local`` as ``key`` of ``store`` atomically (object stores do; ``file://``
    renames a temp)."""
    local, path = os.fspath(local), store.fs_path(key)
    if store.protocol not in LOCAL_PROTOCOLS:
        store.call("upload", key, lambda: store.fs.put_file(local, path))
        return
    tmp = f"{path}.{uuid.uuid4().hex[:12]}.partial"

    def put() -> None:
        try:
            store.fs.put_file(local, tmp)
            store.fs.mv(tmp, path)
        finally:
            if store.fs.exists(tmp):
                store.fs.rm_file(tmp)

    store.call("upload", key, put)


def upload_folder(
    store: RemoteStore,
    folder: str | os.PathLike[str],
    keys: list[str] | None = None,
    check: Callable[[], object] = lambda: None,
) -> list[str]:
    """Upload ``folder``'s files (or those of ``keys``) to ``store``, ``manifest.json`` last: a
    reader finding it finds every shard. ``check()`` runs before the files and before the
    manifest (it raises to stop); the keys. Nothing is deleted at the destination."""
    root = Path(folder)
    if not (root / "manifest.json").is_file():
        raise FileNotFoundError(f"{root / 'manifest.json'}: missing; it must be uploaded last")
    if keys is None:
        keys = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    keys = [k for k in keys if k != "manifest.json"]
    if store.protocol in LOCAL_PROTOCOLS:
        for key in {k.rpartition("/")[0] for k in keys}:
            store.fs.makedirs(store.fs_path(key), exist_ok=True)
    check()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda k: upload_file(store, root / k, k), keys))
    check()
    upload_file(store, root / "manifest.json", "manifest.json")
    store.fs.invalidate_cache()
    return [*keys, "manifest.json"]


def prune_remote(
    url: str, storage_options: Mapping[str, Any] | None = None, *, dry_run: bool = False
) -> list[str]:
    """Delete the shards and catalogs at the shard folder ``url`` that its manifest does not
    name (left by earlier packs for their readers); return their names. ``dry_run`` only lists
    (the one mode over HTTP, where the server lists the folder)."""
    if not is_url(url):
        message = (
            f"{os.fspath(url)} is a local path: pruning deletes the files that earlier packs left "
            "at a URL (s3://, gs://, file://...) for their readers. A local pack needs no "
            "pruning: a re-pack replaces its files, an append removes what it no longer needs"
        )
        if Path(url).is_dir():
            uri = Path(url).absolute().as_uri()
            message += f". If this folder was written through a file:// URL, pass {uri}"
        raise ValueError(message)
    store = RemoteStore(url, storage_options)
    http = store.protocol in HTTP_PROTOCOLS
    if http and not dry_run:
        raise RemoteError(
            f"{store.url_of()}: {store.protocol}:// cannot delete files, so prune cannot remove "
            "stale ones here (a dry run lists them where the server lists the folder). Prune "
            "where the pack is stored: its folder on the server's disk, or the s3:// or gs:// "
            "URL it was uploaded to"
        )
    manifest = parse_manifest(store.read_bytes(fmt.MANIFEST_NAME), store.url_of(fmt.MANIFEST_NAME))
    root = store.fs_path("")
    try:
        names = store.call("list", "", lambda: store.fs.ls(root, detail=False))
    except (RemoteNotFoundError, RemoteAccessError):
        if not http:
            raise
        names = []  # an HTTP server that serves files but no listing (404, or nginx's 403)
    bases = [os.path.basename(str(n).rstrip("/")) for n in names]
    if http and fmt.MANIFEST_NAME not in bases:
        raise RemoteError(
            f"{store.url_of()}: the server lists no files there, so prune cannot find the files "
            "earlier packs left. Prune where the pack is stored (its folder on the server's "
            "disk, or the s3:// or gs:// URL it was uploaded to)"
        )
    keep = set(manifest.files())
    stale = sorted(base for base in bases if _PACK_FILE.match(base) and base not in keep)
    if not dry_run:
        for base in stale:
            store.call("delete", base, functools.partial(store.fs.rm_file, store.fs_path(base)))
        store.fs.invalidate_cache()
    return stale
