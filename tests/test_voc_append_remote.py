"""append_voc on a pack at a URL (the loopback S3 server behind its fault proxy): the pack there
reads as a full re-pack and as torchvision on the grown folder; only new files go up, the
manifest last, and no existing object is written; a reader that opened the URL before keeps
working; a second appender is refused; a failed upload leaves the previous pack, a rerun
completes and ``prune`` removes what the failed one left."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _reliability_helpers import PACK_FORMS, dead_pid, out_name
from test_voc_append import (
    YEAR,
    Source,
    as_bytes,
    assert_same_as_repack,
    assert_same_as_torchvision,
    edit_annotation,
)

from torch_serialized import (
    CacheLimitWarning,
    SourceDataError,
    VOCSerializedDataset,
    append_voc,
    open_pack,
    pack_voc,
)
from torch_serialized.cli import main
from torch_serialized.errors import RemoteError, WriteError
from torch_serialized.remote import upload as uploads
from torch_serialized.remote.retry import RETRY_ATTEMPTS_ENV, RETRY_MAX_DELAY_ENV
from torch_serialized.remote.store import RemoteStore
from torch_serialized.remote.upload import prune_remote
from torch_serialized.voc.append import _append_local
from torch_serialized.voc.append_remote import append_to_url
from torch_serialized.voc.packed import VOCPackReader
from torch_serialized.voc.records import Options

if TYPE_CHECKING:
    from remote_fixtures import Remote

pytest_plugins = ["remote_fixtures"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from torch_serialized.tools import make_synthetic_voc

    return make_synthetic_voc(tmp_path_factory.mktemp("append-remote-src"), 24, year=YEAR)


@pytest.fixture
def source(tmp_path: Path, pristine: Path) -> Source:
    return Source(tmp_path / "src", copy_of=pristine)


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tries, a few milliseconds apart: a fault that persists fails the call quickly."""
    monkeypatch.setenv(RETRY_ATTEMPTS_ENV, "2")
    monkeypatch.setenv(RETRY_MAX_DELAY_ENV, "0.01")


def pack_at(source: Source, remote: Remote, form: str) -> str:
    url = f"{remote.url}/{out_name(form)}"
    pack_voc(
        source.root, url, year=YEAR, storage_options=remote.storage_options, **PACK_FORMS[form]
    )
    return url


def key_of(remote: Remote, url: str, name: str = "") -> str:
    """The key of ``name`` under ``url`` (the URL itself for ''), relative to the test folder."""
    rest = url[len(remote.url) + 1 :]
    return f"{rest}/{name}" if name else rest


def _direct(remote: Remote) -> Any:
    """One s3fs filesystem straight to the server per test (opening one costs ~50 ms)."""
    from remote_fixtures import direct

    fs = getattr(remote, "_direct_fs", None)
    if fs is None:
        fs = direct(remote.kind, remote.served.server.url)
        remote._direct_fs = fs  # type: ignore[attr-defined]
    return fs


def _key(remote: Remote, url: str) -> str:
    from remote_fixtures import BUCKET

    return f"{BUCKET}/{remote.prefix}/{key_of(remote, url)}"


def objects(remote: Remote, url: str) -> dict[str, tuple[str, str]]:
    """Every object under ``url`` (or the object itself, as ''): name -> (ETag, sha256 of its
    bytes), read straight from the server."""
    fs = _direct(remote)
    base = _key(remote, url)
    single = url.endswith(".tser")
    infos = [fs.info(base)] if single else fs.ls(base, detail=True, refresh=True)
    blobs = fs.cat([info["name"] for info in infos])
    return {
        ("" if single else info["name"].rsplit("/", 1)[-1]): (
            info.get("ETag", ""),
            hashlib.sha256(blobs[info["name"]]).hexdigest(),
        )
        for info in infos
    }


def download(remote: Remote, url: str, to: Path) -> Path:
    """The pack at ``url`` as a local copy, fetched straight from the server."""
    fs = _direct(remote)
    to.mkdir(parents=True)
    target = to / ("voc.tser" if url.endswith(".tser") else "voc")
    if url.endswith(".tser"):
        target.write_bytes(fs.cat_file(_key(remote, url)))
        return target
    target.mkdir()
    for name, data in fs.cat(fs.ls(_key(remote, url), detail=False, refresh=True)).items():
        (target / name.rsplit("/", 1)[-1]).write_bytes(data)
    return target


def puts(remote: Remote) -> list[str]:
    """The names of the objects PUT through the proxy, in order."""
    return [
        line.split(" ", 1)[1].rsplit("/", 1)[-1]
        for line in remote.proxy.stats()["log"]
        if line.startswith("PUT ")
    ]


def manifest_files(data: bytes) -> set[str]:
    manifest = json.loads(data)
    return {entry["file"] for entry in manifest["shards"]} | {manifest["catalog"]["file"]}


# -- growing -------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", PACK_FORMS)
def test_append_to_a_url_reads_as_a_full_repack_and_uploads_only_new_files(
    s3_remote: Remote, source: Source, tmp_path: Path, form: str
) -> None:
    source.cut()
    url = pack_at(source, s3_remote, form)
    before = objects(s3_remote, url)
    packed = len(VOCPackReader(download(s3_remote, url, tmp_path / "before")))
    source.grow()
    s3_remote.proxy.reset()

    result = append_voc(
        source.root, url, storage_options=s3_remote.storage_options, cache_dir=tmp_path / "cache"
    )

    assert result.url == url and result.added == len(source.listed()) - packed > 0
    assert result.num_samples == len(source.listed())
    # a shard folder's old shards are not downloaded (every id passed the quick check)
    assert s3_remote.proxy.count("GET", "shard-") == 0 or form == "single"
    grown = download(s3_remote, url, tmp_path / "after")
    assert_same_as_repack(grown, source, tmp_path, form)
    assert_same_as_torchvision(grown, source)
    after = objects(s3_remote, url)
    sent = puts(s3_remote)
    if form == "shards":
        # existing objects untouched (same ETag, same bytes); each new file PUT once, the
        # manifest last; the previous catalog kept for readers of the previous manifest
        assert all(
            after[name] == value for name, value in before.items() if name != "manifest.json"
        )
        manifest = (grown / "manifest.json").read_bytes()
        new = manifest_files(manifest) - set(before)
        assert sorted(sent) == sorted([*new, "manifest.json"]) and sent[-1] == "manifest.json"
        assert set(after) == set(before) | new
        assert any(n.startswith("catalog") for n in new)
        assert result.bytes_written == sum(
            (grown / n).stat().st_size for n in [*new, "manifest.json"]
        )
    else:
        assert sent == [key_of(s3_remote, url)] and after[""] != before[""]
    # the URL reads as the local copy, and nothing already on this machine is downloaded again
    s3_remote.proxy.reset()
    at_url = VOCSerializedDataset(
        url,
        image_set="train",
        decode="none",
        storage_options=s3_remote.storage_options,
        cache_dir=tmp_path / "cache",
    )
    local = VOCSerializedDataset(grown, image_set="train", decode="none")
    assert len(at_url) == len(local) > 0
    assert all(as_bytes(at_url[i][0]) == as_bytes(local[i][0]) for i in range(len(local)))
    if form == "shards":  # the old shards it reads, never a file the append uploaded
        fetched = {
            line.split(" ", 1)[1].rsplit("/", 1)[-1]
            for line in s3_remote.proxy.stats()["log"]
            if line.startswith("GET ")
        }
        assert not fetched & new
        assert all(n.startswith("shard-") for n in fetched - {"", "manifest.json"})
    else:  # its size and footer: never the file's bytes
        assert s3_remote.proxy.stats()["bytes_sent"] < 4096


def test_a_reader_that_opened_before_keeps_working_and_the_next_append_downloads_no_shard(
    store_remote: Remote, source: Source, tmp_path: Path
) -> None:
    """A reader of the URL opened before an append reads the pack it opened after it; one
    opened after sees the grown pack. The first append leaves the grown pack's new files in
    the cache, so the next append on the machine downloads no shard and no catalog."""
    source.cut(0.5)
    url = pack_at(source, store_remote, "shards")
    options = store_remote.storage_options
    old = VOCSerializedDataset(
        url,
        image_set="trainval",
        decode="none",
        storage_options=options,
        cache_dir=tmp_path / "reader",
    )
    first = as_bytes(old[0][0])
    source.cut(0.75)
    append_voc(source.root, url, storage_options=options, cache_dir=tmp_path / "appender")
    assert as_bytes(old[0][0]) == first
    before = [as_bytes(old[i][0]) for i in range(len(old))]  # every old shard still there
    new = VOCSerializedDataset(
        url,
        image_set="trainval",
        decode="none",
        storage_options=options,
        cache_dir=tmp_path / "reader",
    )
    assert len(new) > len(old) == len(before)
    assert [as_bytes(new[i][0]) for i in range(len(old))] == before

    source.grow()
    store_remote.proxy.reset()
    result = append_voc(source.root, url, storage_options=options, cache_dir=tmp_path / "appender")
    assert result.num_samples == len(source.listed())
    assert store_remote.proxy.count("GET", ".tser") == 0
    grown = download(store_remote, url, tmp_path / "grown")
    assert_same_as_repack(grown, source, tmp_path, "shards")


def test_nothing_new_uploads_nothing_and_killed_stagings_are_removed(
    s3_remote: Remote, source: Source, tmp_path: Path
) -> None:
    url = pack_at(source, s3_remote, "shards")
    killed = tmp_path / "c" / f".append-staging.tmp-{dead_pid()}-0badcafe"
    (killed / "voc").mkdir(parents=True)  # what an append killed while staging left
    s3_remote.proxy.reset()
    result = append_voc(
        source.root, url, storage_options=s3_remote.storage_options, cache_dir=tmp_path / "c"
    )
    assert result.bytes_written == 0 and "up to date" in result.notes[0] and url in result.notes[0]
    assert puts(s3_remote) == []
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".append")]


@pytest.mark.parametrize("form", ["shards"])
def test_replace_changed_through_a_url(
    s3_remote: Remote, source: Source, tmp_path: Path, form: str
) -> None:
    source.cut()
    url = pack_at(source, s3_remote, form)
    before = objects(s3_remote, url)
    victim = VOCPackReader(download(s3_remote, url, tmp_path / "before")).id(1)
    edit_annotation(source, victim)
    source.grow()
    options = {"storage_options": s3_remote.storage_options, "cache_dir": tmp_path / "cache"}
    s3_remote.proxy.reset()
    with pytest.raises(SourceDataError, match=rf"{url}: 1 packed ids changed.*{victim}") as err:
        append_voc(source.root, url, **options)
    assert ".append-" not in str(err.value)  # the URL is named, not the staged copy
    assert puts(s3_remote) == [] and objects(s3_remote, url) == before

    result = append_voc(source.root, url, replace_changed=True, **options)

    assert result.replaced == [victim]
    grown = download(s3_remote, url, tmp_path / "after")
    assert_same_as_repack(grown, source, tmp_path, form)
    assert_same_as_torchvision(grown, source, decode_set=None)


@pytest.mark.parametrize("form", PACK_FORMS)
def test_append_to_a_file_url(source: Source, tmp_path: Path, form: str) -> None:
    """Any writable fsspec URL, not only S3: ``file://`` (uploads are a copy and a rename)."""
    source.cut()
    (tmp_path / "out").mkdir()
    path = tmp_path / "out" / out_name(form)
    url = f"file://{path}"
    pack_voc(source.root, url, year=YEAR, **PACK_FORMS[form])
    before = {p.name: p.stat().st_ino for p in path.iterdir()} if form == "shards" else {}
    source.grow()
    result = append_voc(source.root, url, cache_dir=tmp_path / "cache")
    assert result.url == url and result.num_samples == len(source.listed())
    assert_same_as_repack(path, source, tmp_path, form)
    after = {p.name: p.stat().st_ino for p in path.iterdir()} if form == "shards" else {}
    assert all(after[n] == i for n, i in before.items() if n != "manifest.json")


def test_errors_of_the_staged_append_name_the_url(tmp_path: Path) -> None:
    from torch_serialized.voc.append_remote import _naming

    local, url = tmp_path / "stage" / "voc", "s3://bucket/prefix/voc"
    for exc in (
        WriteError(16, f"{local} is being written"),
        FileNotFoundError(2, "No such file", str(local / "shard-00001.tser")),
        SourceDataError(f"{local}: 1 packed ids changed"),
    ):
        with pytest.raises(type(exc)) as err, _naming(local, url):
            raise exc
        assert url in str(err.value) and str(local) not in str(err.value)


def test_a_url_over_http_is_read_only(source: Source) -> None:
    with pytest.raises(ValueError, match=r"https://127\.0\.0\.1:9/voc: .*read-only"):
        append_voc(source.root, "https://127.0.0.1:9/voc")


# -- concurrency and failures --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("form", "when"), [("single", "staged"), ("shards", "staged"), ("shards", "uploading")]
)
def test_a_second_appender_that_finished_first_wins_and_this_one_is_refused(
    store_remote: Remote,
    source: Source,
    tmp_path: Path,
    form: str,
    when: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another append, started later, commits while this one grows its staged copy (then this
    one uploads nothing) or while it uploads (then its uploads are strays for ``prune``)."""
    source.cut(0.5)
    url = pack_at(source, store_remote, form)
    options = store_remote.storage_options
    source.cut(0.75)
    first = prune_remote(url, options, dry_run=True) if form == "shards" else []

    def other_append() -> None:
        source.grow()
        append_voc(source.root, url, storage_options=options, cache_dir=tmp_path / "other")

    def racing(local: Path) -> Any:
        # this append, on its staged copy, which holds only the shards an append reads
        grown = _append_local(source.root, local, Options(), check_shards=False)
        if when == "staged":
            other_append()
        return grown

    if when == "uploading":
        upload = uploads.upload_file

        def upload_then_race(store: RemoteStore, local: Any, key: str = "") -> None:
            upload(store, local, key)
            if key.startswith("shard-") and not getattr(racing, "raced", False):
                racing.raced = True  # type: ignore[attr-defined]
                other_append()

        monkeypatch.setattr(uploads, "upload_file", upload_then_race)

    with pytest.raises(WriteError, match=rf"{url} changed since this append read it"):
        append_to_url(
            url, racing, lambda reader: None, storage_options=options, cache_dir=tmp_path / "cache"
        )

    winner = download(store_remote, url, tmp_path / "after")
    assert_same_as_repack(winner, source, tmp_path, form)
    if form == "shards":  # what the loser uploaded is named by no manifest: prune finds it
        stale = [n for n in prune_remote(url, options, dry_run=True) if n not in first]
        loser = [n for n in stale if n.startswith("shard-")]
        assert bool(loser) == (when == "uploading")


#: upload faults, each failing an append at another step: a new catalog answered 503, the
#: connection dropped under a new shard, the manifest answered 503
UPLOAD_FAULTS = [("status", "catalog"), ("drop", "shard-"), ("status", "manifest.json")]


def test_failed_uploads_leave_the_previous_pack_and_a_rerun_completes(
    s3_remote: Remote, source: Source, tmp_path: Path, fast_retries: None
) -> None:
    source.cut()
    url = pack_at(source, s3_remote, "shards")
    options = {"storage_options": s3_remote.storage_options, "cache_dir": tmp_path / "cache"}
    before = objects(s3_remote, url)
    previous = VOCPackReader(download(s3_remote, url, tmp_path / "previous"))
    source.grow()
    for fault, where in UPLOAD_FAULTS:
        s3_remote.proxy.add_fault(fault, method="PUT", path=where, count=None)
        with pytest.raises(RemoteError, match=rf"{where}.*upload failed after s3.s own retries"):
            append_voc(source.root, url, **options)
        s3_remote.proxy.clear_faults()
        after = objects(s3_remote, url)
        assert all(after[n] == v for n, v in before.items())  # the previous pack, exactly
        again = VOCPackReader(download(s3_remote, url, tmp_path / f"after-{where}"))
        assert again.files() == previous.files() and len(again.live) == len(previous.live)

    result = append_voc(source.root, url, **options)

    assert result.num_samples == len(source.listed())
    assert_same_as_repack(download(s3_remote, url, tmp_path / "grown"), source, tmp_path, "shards")
    strays = set(after) - set(before)  # what the failed appends uploaded: prune removes it
    assert strays and all(n.startswith(("shard-", "catalog")) for n in strays)
    stale = prune_remote(url, s3_remote.storage_options)
    assert strays <= set(stale)
    assert_same_as_repack(download(s3_remote, url, tmp_path / "pruned"), source, tmp_path, "shards")


def test_truncated_downloads_of_the_old_shards_leave_the_pack_and_a_rerun_completes(
    s3_remote: Remote, source: Source, tmp_path: Path, fast_retries: None
) -> None:
    """An id whose file's time changed is compared by content: its shard is downloaded
    through the cache. Bodies cut short every time fail the append before anything goes up;
    once, they are retried and the append completes."""
    source.cut()
    url = pack_at(source, s3_remote, "shards")
    options = {"storage_options": s3_remote.storage_options, "cache_dir": tmp_path / "cache"}
    before = objects(s3_remote, url)
    source.grow()
    touched = source.file("Annotations", source.listed()[0])
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    s3_remote.proxy.reset()
    s3_remote.proxy.add_fault("truncate", method="GET", path="shard-", count=None)
    with pytest.raises(RemoteError, match="shard-"):
        append_voc(source.root, url, **options)
    assert puts(s3_remote) == [] and objects(s3_remote, url) == before
    s3_remote.proxy.reset()
    s3_remote.proxy.add_fault("truncate", method="GET", path="shard-", count=1)
    result = append_voc(source.root, url, **options)
    assert s3_remote.proxy.stats()["faults"] == {"truncate": 1}
    assert result.num_samples == len(source.listed())
    assert_same_as_repack(download(s3_remote, url, tmp_path / "grown"), source, tmp_path, "shards")


@pytest.mark.parametrize("form", PACK_FORMS)
def test_the_result_of_an_append_to_a_url_gives_the_size_of_the_pack_there(
    store_remote: Remote, source: Source, tmp_path: Path, form: str
) -> None:
    # not the size of the staged copy, which holds the new files and those read only
    source.cut()
    url = pack_at(source, store_remote, form)
    source.grow()
    options = {"storage_options": store_remote.storage_options, "cache_dir": tmp_path / "cache"}
    for _ in range(2):  # an append, then one with nothing to write
        result = append_voc(source.root, url, **options)
        assert result.num_bytes == open_pack(url, **options).nbytes
        assert result.bytes_written < result.num_bytes or form == "single"
    assert result.bytes_written == 0


# -- command line --------------------------------------------------------------------------------
def test_cli_append_to_a_url(
    s3_remote: Remote, source: Source, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source.cut()
    url = pack_at(source, s3_remote, "shards")
    before = VOCPackReader(download(s3_remote, url, tmp_path / "before"))
    packed = {before.id(r) for r in range(len(before))}
    source.grow()
    bad = next(i for i in source.listed() if i not in packed)
    source.file("JPEGImages", bad).write_bytes(b"not an image")
    argv = ["--storage-options", json.dumps(s3_remote.storage_options)]
    argv += ["--cache-dir", str(tmp_path / "cache")]
    s3_remote.proxy.configure(latency=0.2)  # every request: the transfers take >= 0.2 s
    assert main(["pack", str(source.root), url, "--append", "--quiet", "--skip-bad", *argv]) == 0
    s3_remote.proxy.configure()
    out = capsys.readouterr().out
    assert f"appended to {url} (new files uploaded, manifest last)" in out
    transfer = re.search(r"\n  transfer ([\d.]+) s \(downloads and upload\)\n", out)
    assert transfer and float(transfer[1]) >= 0.2, out  # timed apart from the append itself
    assert f"{len(source.listed()) - 1} samples" in out
    assert f"reasons in {url}.skipped.json" in out
    assert bad in s3_remote.get(key_of(s3_remote, url) + ".skipped.json").decode()
    assert main(["info", url, *argv]) == 0
    assert "append" in capsys.readouterr().out
    fresh = pack_voc(source.root, tmp_path / "fresh", year=YEAR, on_error="skip")
    grown = VOCPackReader(download(s3_remote, url, tmp_path / "grown"))
    assert grown.meta["splits"] == VOCPackReader(fresh.path).meta["splits"]


def test_cli_append_to_a_url_bounds_the_cache_it_stages_through(
    s3_remote: Remote, source: Source, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = pack_at(source, s3_remote, "shards")
    argv = ["--storage-options", json.dumps(s3_remote.storage_options)]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--cache-limit", "1"]
    with pytest.warns(CacheLimitWarning, match="cache_limit_bytes=1"):  # the limit is used
        assert main(["pack", str(source.root), url, "--append", "--quiet", *argv]) == 0
    assert "up to date" in capsys.readouterr().out


# -- killed --------------------------------------------------------------------------------------
_CHILD = """
import json, sys
sys.path[:0] = [sys.argv[1]]
from _reliability_helpers import light_import
light_import()
from torch_serialized.voc.append import append_voc
append_voc(sys.argv[2], sys.argv[3], storage_options=json.loads(sys.argv[4]), cache_dir=sys.argv[5])
"""


@pytest.mark.slow  # spawns the appender it kills
@pytest.mark.parametrize("form", PACK_FORMS)
def test_an_append_killed_while_uploading_leaves_the_previous_pack_and_a_rerun_completes(
    s3_remote: Remote, source: Source, tmp_path: Path, form: str
) -> None:
    import subprocess
    import sys
    import time

    from remote_fixtures import S3_ENVIRONMENT

    source.cut()
    url = pack_at(source, s3_remote, form)
    before = objects(s3_remote, url)
    source.grow()
    name = "shard-" if form == "shards" else out_name(form)
    s3_remote.proxy.reset()
    s3_remote.proxy.add_fault("delay", method="PUT", path=name, delay=60, count=None)
    tests = str(Path(__file__).parent)
    options = json.dumps(s3_remote.storage_options)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, tests, str(source.root), url, options, str(tmp_path / "c")],
        env={**os.environ, **S3_ENVIRONMENT, "PYTHONPATH": str(Path(tests).parent)},
    )
    try:
        deadline = time.monotonic() + 60
        while not any(line.startswith("PUT ") for line in s3_remote.proxy.stats()["log"]):
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    s3_remote.proxy.clear_faults()
    after = objects(s3_remote, url)  # nothing replaced: the previous pack, exactly
    assert all(after[n] == v for n, v in before.items())
    previous = download(s3_remote, url, tmp_path / "previous")
    assert len(VOCPackReader(previous).live) < len(source.listed())

    result = append_voc(
        source.root, url, storage_options=s3_remote.storage_options, cache_dir=tmp_path / "c"
    )

    assert result.num_samples == len(source.listed())
    assert_same_as_repack(download(s3_remote, url, tmp_path / "grown"), source, tmp_path, form)
