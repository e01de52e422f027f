"""The command line over packs at URLs: info, verify, export, pack, prune and cache."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _remote_cases import NOT_GCS

from torch_serialized import pack_voc
from torch_serialized.cli import main

if TYPE_CHECKING:
    from remote_fixtures import Remote

pytest_plugins = ["remote_fixtures"]


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse: usage errors
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_pack_to_a_url_times_its_upload_apart(
    store_remote: Remote, voc8: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The summary's time is the local pack's; the upload after it gets its own line (it
    said nothing of it, however long the upload took)."""
    url = store_remote.url + "/voc"
    store_remote.proxy.configure(latency=0.3)  # every request: the upload takes >= 0.3 s
    options = ["--storage-options", json.dumps(store_remote.storage_options)]
    status, out, err = run(capsys, "pack", voc8, url, "--samples-per-shard", 3, "-q", *options)
    store_remote.proxy.configure()
    assert status == 0, err
    packing = re.search(r"\n  time +([\d.]+) s: ", out)
    upload = re.search(r"\n  upload +([\d.]+) s: ([\d.,]+) MB/s\n", out)
    assert packing and upload, out
    assert float(upload[1]) >= 0.3 > float(packing[1])


@pytest.mark.slow
def test_pack_info_verify_export_prune_and_cache_over_s3(
    s3_remote: Remote, voc8: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = s3_remote.url + "/voc"
    options = json.dumps(s3_remote.storage_options)
    cache = tmp_path / "cache"
    writing = ["--storage-options", options]  # pack and prune do not read through the cache
    remote = [*writing, "--cache-dir", cache]
    status, out, _ = run(capsys, "pack", voc8, url, "--samples-per-shard", 3, "-q", *writing)
    assert status == 0 and f"{url} (uploaded, manifest last)" in out
    status, _, err = run(capsys, "pack", voc8, url, "--samples-per-shard", 3, "-q", *writing)
    assert status == 2 and "--overwrite" in err
    status, _, err = run(capsys, "pack", voc8, url, "-q", "--overwrite", *remote)
    assert status == 2 and "--cache-dir only applies with --append to a URL" in err
    status, out, _ = run(capsys, "info", url, "--json", *remote)
    info = json.loads(out)
    assert status == 0 and info["path"] == url and info["num_samples"] == 8
    assert Path(info["cached_in"]).is_relative_to(cache)
    status, out, _ = run(capsys, "verify", url, *remote, "--cache-limit", "1GB")
    assert status == 0 and out.startswith(f"OK {url}")
    status, out, _ = run(capsys, "export", url, tmp_path / "out", "-q", *remote)
    assert status == 0
    exported = sorted(p.name for p in (tmp_path / "out").rglob("*.xml"))
    assert exported == sorted(p.name for p in voc8.rglob("*.xml"))
    status, _, _ = run(capsys, "pack", voc8, url, "--shards", 2, "-q", "--overwrite", *writing)
    assert status == 0
    status, out, _ = run(capsys, "prune", url, "--dry-run", *writing)
    assert status == 0 and "would delete 4 file(s)" in out  # 3 shards and a catalog
    status, out, _ = run(capsys, "prune", url, *writing)
    assert status == 0 and "deleted 4 file(s)" in out
    status, out, _ = run(capsys, "verify", url, *remote)
    assert status == 0 and "in 2 shards" in out

    status, out, _ = run(capsys, "cache", "list", "--cache-dir", cache, "--json")
    listed = json.loads(out)  # the re-pack only: opening it removed the first pack's folder
    assert status == 0 and len(listed) == 1 and {p["url"] for p in listed} == {url}
    status, out, _ = run(capsys, "cache", "list", "--cache-dir", cache)
    assert status == 0 and "1 pack(s)" in out and url in out
    status, out, _ = run(capsys, "cache", "clear", "--cache-dir", cache)
    assert status == 0 and "removed 1 pack(s)" in out
    status, out, _ = run(capsys, "cache", "list", "--cache-dir", cache)
    assert "0 pack(s)" in out


def test_a_missing_url_is_one_line_naming_it(
    remote: Remote, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = remote.url + "/nothing"
    options = json.dumps(remote.storage_options)
    status, _, err = run(capsys, "info", url, "--storage-options", options, "--cache-dir", tmp_path)
    assert status == 2 and "nothing" in err and "not found" in err
    status, _, err = run(capsys, "info", url, "--storage-options", "[1]")
    assert status == 2 and "JSON object" in err


def test_verify_names_a_damaged_shard_at_a_url(
    remote: Remote, voc8: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pack = pack_voc(voc8, tmp_path / "p", max_samples_per_shard=3).path
    files = sorted(pack.iterdir(), key=lambda f: f.name == "manifest.json")
    shard = next(f for f in files if f.name.startswith("shard-"))
    for f in files:
        data = bytearray(f.read_bytes())
        if f == shard:
            data[4096] ^= 1
        remote.put(f.name, bytes(data))
    options = json.dumps(remote.storage_options)
    status, out, _ = run(
        capsys, "verify", remote.url, "--storage-options", options, "--cache-dir", tmp_path / "c"
    )
    assert status == 1 and "1 damaged shard" in out and shard.name in out


def test_cache_list_hides_passwords_and_shows_partial_downloads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch_serialized.remote.cache import Cache

    pc = Cache(tmp_path).pack("https://alice:S3cretPW@127.0.0.1:1/voc?sig=T0ken", "i")
    pc.put("manifest.json", b"{}")
    pc.close()
    (pc.directory / ".s.tser.0123456789ab.partial").write_bytes(b"x" * 300_000)
    status, out, _ = run(capsys, "cache", "list", "--cache-dir", tmp_path)
    assert status == 0 and "https://alice:***@127.0.0.1:1/voc?…" in out
    assert "0.3 MB partly downloaded" in out
    status, out, _ = run(capsys, "cache", "list", "--cache-dir", tmp_path, "--json")
    assert "S3cretPW" not in out and "T0ken" not in out
    assert json.loads(out)[0]["partial_bytes"] == 300_000


@NOT_GCS
def test_info_of_a_url_downloads_only_the_manifest_and_the_catalog(
    remote: Remote, voc8: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # README: opening reads manifest.json and the catalog; `info` needs nothing else, its
    # class histogram included (the catalog holds every object's class id)
    pack = pack_voc(voc8, tmp_path / "p", max_samples_per_shard=3).path
    for f in sorted(pack.iterdir(), key=lambda f: f.name == "manifest.json"):
        remote.put(f.name, f.read_bytes())
    catalog = next(f.name for f in pack.iterdir() if f.name.startswith("catalog-"))
    options = json.dumps(remote.storage_options)
    argv = ["--storage-options", options, "--cache-dir", tmp_path / "cache"]
    local = json.loads(run(capsys, "info", pack, "--json")[1])
    remote.proxy.reset()
    status, out, _ = run(capsys, "info", remote.url, "--json", *argv)
    assert status == 0 and json.loads(out)["classes"] == local["classes"] != {}
    fetched = {
        line.split(" ", 1)[1].rsplit("/", 1)[-1]
        for line in remote.proxy.stats()["log"]
        if line.startswith("GET ")
    }
    assert fetched == {"manifest.json", catalog}
    status, out, _ = run(capsys, "info", remote.url, *argv)
    assert status == 0 and "classes" in out


@pytest.mark.parametrize("remote", ["http"], indirect=True)
def test_prune_dry_run_over_http_without_a_listing_says_so(
    remote: Remote,
    voc8: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the loopback HTTP server serves files, no folder listing: prune cannot find stale
    # files there, which is no fault of the URL (no "check the bucket name")
    pack = pack_voc(voc8, tmp_path / "p", max_samples_per_shard=3).path
    for f in pack.iterdir():
        remote.put(f.name, f.read_bytes())
    status, out, err = run(capsys, "prune", remote.url, "--dry-run")
    assert status == 2 and remote.url in err and "lists no files" in err
    assert "bucket" not in err and "server's disk" in err
    # nginx with listing off answers 403 for the folder: no "check the credentials" either
    from fsspec.implementations.http import HTTPFileSystem

    async def forbidden(self: Any, url: str, detail: bool = True, **kwargs: Any) -> Any:
        raise PermissionError(errno.EACCES, "Forbidden", url)

    monkeypatch.setattr(HTTPFileSystem, "_ls_real", forbidden)
    status, out, err = run(capsys, "prune", remote.url, "--dry-run")
    assert status == 2 and "lists no files" in err and "credentials" not in err


def test_cache_list_counts_the_files_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pack whose files a process holds says how many, so ``cache clear`` leaving them is
    no surprise; once they are let go the line says nothing of it."""
    from torch_serialized.remote.cache import Cache

    pc = Cache(tmp_path).pack("s3://bucket/voc", "0123456789abcdef")
    pc.put("manifest.json", b"{}")  # held by this process until closed
    line = r"  s3://bucket/voc  \[0123456789ab\]  1 file\(s\), [^,]+, last used [-\d]+ [:\d]+"
    status, out, _ = run(capsys, "cache", "list", "--cache-dir", tmp_path)
    assert status == 0 and re.search(line + r", 1 in use\n", out), out
    pc.close()
    status, out, _ = run(capsys, "cache", "list", "--cache-dir", tmp_path)
    assert status == 0 and re.search(line + r"\n", out), out
