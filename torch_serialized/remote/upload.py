"""Packs written to a URL: written locally first, then uploaded, the manifest last.

``write_then_upload`` wraps a local write (``pack_voc`` to a path) so that the pack goes up
only once it is whole: the shards and the catalog first, then the manifest, which is what
makes a reader see the new pack. A write names its shards and catalog with a fresh token
(docs/FORMAT.md, "Shard folders"), so a re-pack never overwrites a file the previous manifest
names: its readers keep reading. ``prune_remote`` removes those older files.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..container import spec as fmt
from ..container.manifest import parse_manifest
from ..errors import RemoteAccessError, RemoteError, RemoteNotFoundError
from .store import HTTP_PROTOCOLS, RemoteStore, is_url, protocol_of, redact_url

__all__ = [
    "READ_ONLY_PROTOCOLS",
    "check_writable",
    "local_prune_refusal",
    "prune_remote",
    "write_then_upload",
]

#: URL schemes packs are read from but never written to or deleted at (fsspec's HTTP
#: filesystem only reads).
READ_ONLY_PROTOCOLS = HTTP_PROTOCOLS
#: What a file of a pack written by torch_serialized is called (shards and catalogs), the only
#: names ``prune_remote`` ever deletes.
_PACK_FILE = re.compile(r"^(shard-\d+|catalog)(-[0-9a-f]+)?\.tser$")
#: The suffix of the skipped-samples report (``voc.pack.REPORT_SUFFIX``).
REPORT_SUFFIX = ".skipped.json"

R = TypeVar("R")


def check_writable(url: str, verb: str) -> None:
    """Refuse, before any work, to ``verb`` ("pack", "append") a pack at a read-only URL
    (``READ_ONLY_PROTOCOLS``): otherwise the upload fails only once the pack is built."""
    protocol = protocol_of(url)
    if protocol in READ_ONLY_PROTOCOLS:
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
    """Run ``write(local_path)`` into a temporary folder (under ``$TMPDIR``), upload what
    it wrote to ``url`` (a shard folder with its manifest last, or one file) and return its
    result. ``written(result)`` is the local output; ``report(result)``, if any, goes up as
    ``url + ".skipped.json"``. Nothing is uploaded if ``write`` fails."""
    store = RemoteStore(url, storage_options)
    name = store.url.rsplit("/", 1)[-1] or "pack"
    with tempfile.TemporaryDirectory(prefix="torch_serialized-upload-") as tmp:
        result = write(Path(tmp) / name)
        local = written(result)
        if local.is_dir():
            store.upload_folder(local, last=[fmt.MANIFEST_NAME])
        else:
            store.upload_file(local)
        skipped = report(result)
        if skipped is not None:
            RemoteStore(store.url + REPORT_SUFFIX, storage_options).upload_file(skipped)
    return result


def local_prune_refusal(path: str | os.PathLike[str], retry: str) -> str:
    """Why a local ``path`` is not pruned: what pruning is for, why a local pack needs none,
    and for a folder the ``file://`` URL to prune if it was written through one (``retry``
    says how: "pass" from Python, "run torch-serialized prune" from the command line)."""
    text = os.fspath(path)
    message = (
        f"{text} is a local path: pruning deletes the shard and catalog files that earlier "
        "packs left at a URL (s3://, gs://, file://...), where a re-pack uploads new files "
        "beside the old ones for the readers still using them. A local pack needs no pruning: "
        "a re-pack replaces its files, an append keeps only the previous catalog (the next "
        "append removes it), and the next pack or append of the same path removes what an "
        "interrupted one left"
    )
    if Path(text).is_dir():
        message += (
            f". If this folder was written through a file:// URL, {retry} "
            f"{Path(text).absolute().as_uri()}"
        )
    return message


def prune_remote(
    url: str, storage_options: Mapping[str, Any] | None = None, *, dry_run: bool = False
) -> list[str]:
    """Delete the shards and catalogs under the shard folder at ``url`` that its current
    manifest does not name (left by earlier packs at the same URL); return their names.

    Run it when no reader of an earlier pack is still reading: such a reader fetches shards
    of the manifest it opened, and would fail on one that was pruned. Only files named like
    a pack's files are considered; ``dry_run`` lists without deleting. Over HTTP only a dry
    run works, and only where the server lists the folder (``python -m http.server`` does);
    elsewhere ``RemoteError`` says where to look instead. A local path raises ``ValueError``
    saying why a local pack needs no pruning.
    """
    if not is_url(url):
        raise ValueError(local_prune_refusal(url, "pass"))
    store = RemoteStore(url, storage_options)
    if not dry_run and store.protocol in READ_ONLY_PROTOCOLS:
        raise RemoteError(
            f"{store.url_of()}: {store.protocol}:// cannot delete files, so prune cannot remove "
            "stale ones here (a dry run lists them where the server lists the folder). Prune "
            "where the pack is stored: its folder on the server's disk (delete the listed "
            "files), or the s3:// or gs:// URL it was uploaded to"
        )
    manifest = parse_manifest(store.read_bytes(fmt.MANIFEST_NAME), store.url_of(fmt.MANIFEST_NAME))
    keep = set(manifest.files())
    root = store.fs_path("")
    try:
        names = store.call("list", "", lambda: store.fs.ls(root, detail=False))
    except (RemoteNotFoundError, RemoteAccessError):
        if store.protocol not in READ_ONLY_PROTOCOLS:
            raise
        names = []  # an HTTP server that serves files but no listing (404, or nginx's 403)
    bases = [os.path.basename(str(n).rstrip("/")) for n in names]
    if store.protocol in READ_ONLY_PROTOCOLS and fmt.MANIFEST_NAME not in bases:
        raise RemoteError(
            f"{store.url_of()}: the server lists no files there (it served manifest.json, so "
            "the URL is right, but no listing of the folder), so prune cannot find the files "
            "earlier packs left. Look where the pack is stored: in its folder on the server's "
            "disk, the shard-*.tser and catalog-*.tser files manifest.json does not name are "
            "stale; or prune the s3:// or gs:// URL it was uploaded to"
        )
    stale = sorted(base for base in bases if _PACK_FILE.match(base) and base not in keep)
    if not dry_run:
        for base in stale:
            store.call("delete", base, functools.partial(store.fs.rm_file, store.fs_path(base)))
        store.fs.invalidate_cache()
    return stale
